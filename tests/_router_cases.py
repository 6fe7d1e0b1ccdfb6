"""Mixture-of-experts router losses at the model level: ``seqpar.router_aux_loss`` against transformers' own aux_loss.

Run inside the spawns of tests/test_transformers.py (no spawn of their own).
"""

from __future__ import annotations

import copy

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from tests._models import SEQ, build, tokens

__all__ = ["check_router_loss"]


def _one_process(ref, ids, mask, positions):
    """transformers' aux_loss of the whole batch and its gradients (packed rows: each document its own row)."""
    ref.zero_grad()
    out = ref(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    out.aux_loss.backward()
    return out.aux_loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def check_router_loss(rank: int, world_size: int, mesh) -> None:
    """Mixtral and Qwen3-MoE (4 layers, 4 experts, top-2): each rank's share summed over the group equals the
    one-process model's aux_loss, and the summed gradients its gradients, with right padding (attention mask)
    and seqpar's own layout padding (45 tokens), and for packed rows (position ids restarting, no mask)."""
    width = SEQ - 3  # not a multiple of 2P: seqpar pads every row, and those tokens must not count
    ids = tokens(2, width, 6)
    padded = torch.ones_like(ids)
    padded[1, -9:] = 0  # right padding in row 1
    packed = torch.cat([torch.arange(n) for n in (13, 20, 12)])[None].expand(2, width)
    for kind in ("mixtral", "qwen3_moe"):
        ref = build(kind).train()
        for mask, positions in ((padded, None), (None, packed)):
            want, grads = _one_process(ref, ids, mask, positions)
            model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
            batch = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
            shard = seqpar.shard_batch({k: v for k, v in batch.items() if v is not None}, mesh)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            share = seqpar.router_aux_loss(
                out.router_logits, model.num_experts, model.num_experts_per_tok, shard["token_mask"], mesh
            )
            share.backward()
            seqpar.reduce_gradients(model.parameters(), mesh)
            what = f"{kind} mask={mask is not None} P={world_size}"
            torch.testing.assert_close(seqpar.sum_over(share, mesh), want, atol=0, rtol=1e-6, msg=what)
            for name, p in model.named_parameters():
                if name in grads:  # the router weights and everything below them
                    torch.testing.assert_close(p.grad, grads[name], atol=1e-7, rtol=1e-4, msg=f"{what} {name}")
                else:
                    assert p.grad is None or not p.grad.any(), f"{what} {name}"
            assert any("gate" in n or "router" in n for n in grads), what
    with pytest.raises(SeqparInputError, match="token_mask has"):
        seqpar.router_aux_loss(out.router_logits, 4, 2, shard["token_mask"][:, :1], mesh)
