"""FlexAttention under ``seqpar.context_parallel``: whole-sequence BlockMasks and soft-capping against one process.

Real gloo ranks. The reference is dense masked SDPA (or plain softmax, with soft-capping) on the whole sequence,
the mask evaluated densely from the same ``mask_mod`` (torch's flex has no CPU backward). fp32 outputs, losses
and every gradient with rtol 1e-5 / atol 1e-6 (losses and parameter gradients averaged over the ranks, as in
tests/test_context_parallel.py). BlockMasks use small blocks (4 x 8 tokens) so that the block tables skip,
keep whole and mask tiles of every strategy.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import seqpar
from seqpar import context_parallel, context_parallel_unshard
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.context_parallel.flex_masks import blockwise_mask, sequence_mask_of
from seqpar.sequence_parallel.context_parallel.flex_mode import flex_attention, softcap_score_mod
from seqpar.sequence_parallel.masks import BlockwiseMask, SequenceMask
from tests._dist import run_ranks, shard_index
from tests._sdpa_models import apply_rope, rope_table

FP32 = dict(rtol=1e-5, atol=1e-6)
SEQ = 48  # divides 2P for P = 2, 3
BLOCK = (4, 8)  # BlockMask blocks (queries, keys)
DOCS = ([13, 20, 15], [30, 18])  # packed documents of the two rows
WINDOW = 7


def _document_ids() -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in DOCS])  # [B, S]


def _mask_mods() -> dict:
    """torchtitan-style mask_mods over global indices: document-causal, and with a sliding window."""
    docs = _document_ids()

    def document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    def sliding(b, h, q_idx, kv_idx):
        return document(b, h, q_idx, kv_idx) & (q_idx - kv_idx < WINDOW)

    return {"full": document, "sliding": sliding}


class FlexLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, rope, mask, attend):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = attend(apply_rope(q, rope), apply_rope(k, rope), v, mask)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.mlp_norm(x))


class FlexModel(nn.Module):
    """Token ids -> logits; layer i attends under ``masks[kinds[i]]`` through ``attend(q, k, v, mask)``."""

    kinds = ("full", "sliding", "full")

    def __init__(self, vocab: int = 64, dim: int = 48, heads: int = 6, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(FlexLayer(dim, heads, kv_heads) for _ in self.kinds)
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("rope", rope_table(SEQ, dim // heads))

    def forward(self, ids, masks, attend):
        x = self.embed(ids)
        for kind, layer in zip(self.kinds, self.layers):
            x = layer(x, self.rope, masks[kind], attend)
        return self.head(self.norm(x))


def _flex(q, k, v, mask):
    return flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True)


def _dense(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)


def _avg(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world


def _check_model(rank, world, cases):
    torch.manual_seed(0)
    model = FlexModel(kv_heads=world)  # GQA 6:2 at P = 2, 6:3 at P = 3 (Ulysses splits the KV heads)
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    mods = _mask_mods()
    dense = {kind: create_mask(mod, 2, 1, SEQ, SEQ, device="cpu") for kind, mod in mods.items()}
    loss_ref = F.cross_entropy(model(tokens[:, :-1], dense, _dense).flatten(0, 1), tokens[:, 1:].flatten())
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for strategy, mesh, layout in cases:
        model.zero_grad(set_to_none=True)
        masks = {
            kind: create_block_mask(mod, 2, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
            for kind, mod in mods.items()
        }
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        buffers = (ids, labels, model.rope, *masks.values())
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=(1, 1, 0, 0, 0), strategy=strategy, layout=layout):
            assert masks["full"].shape[-2:] == (SEQ // world, SEQ // world), "a BlockMask buffer is the shard's"
            loss = F.cross_entropy(model(ids, masks, _flex).flatten(0, 1), labels.flatten())
        loss.backward()
        what = f"flex model P={world} {strategy} {layout}"
        assert masks["full"].shape[-2:] == (SEQ, SEQ), f"{what}: BlockMask not restored"
        torch.testing.assert_close(_avg(loss, world), loss_ref.detach(), **FP32, msg=f"{what}: loss")
        for n, p in model.named_parameters():
            torch.testing.assert_close(_avg(p.grad, world), grads_ref[n], **FP32, msg=f"{what}: {n}")


def _prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 10) | (q_idx >= kv_idx)  # bidirectional over a 10-token prefix, causal after it


def _chunked(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx // 12 == kv_idx // 12)  # causal inside chunks of 12 (Llama 4)


def _dilated(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 != 1)  # causal, no documents or window: blockwise


def _check_recognition():
    """Which seqpar mask each BlockMask becomes: documents and windows where exact, else blockwise."""
    lengths = [torch.tensor(row) for row in DOCS]
    positions = torch.stack([torch.cat([torch.arange(int(n)) for n in row]) for row in lengths])
    documents = seqpar.sequence_mask(positions).starts  # seqpar's own reading of the packed rows
    mods = _mask_mods()
    for mod, window, starts in (
        (mods["full"], None, documents),
        (mods["sliding"], WINDOW, documents),
        (_chunked, None, (torch.arange(SEQ) - torch.arange(SEQ) % 12).expand(2, -1)),
    ):
        block = create_block_mask(mod, None if mod is _chunked else 2, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
        mask, causal = sequence_mask_of(blockwise_mask(block, 2))
        assert causal and mask.predicate is None and mask.window == window, mod.__name__
        torch.testing.assert_close(mask.starts, starts, rtol=0, atol=0, msg=mod.__name__)

    def almost(b, h, q_idx, kv_idx):  # the document mask but for one pair: the check must see it
        return mods["full"](b, h, q_idx, kv_idx) & ~((q_idx == 20) & (kv_idx == 15))

    for mod, within in ((_dilated, True), (_prefix_lm, False), (almost, True)):
        block = create_block_mask(mod, 2, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
        mask, causal = sequence_mask_of(blockwise_mask(block, 2))
        assert mask.predicate is not None and causal == within, mod.__name__


def _gemma_softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


def _softmax_reference(q, k, v, keep, softcap):
    """Plain softmax attention in float64 with a ``[B or 1, 1, S, S]`` mask and optional soft-capping."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def _check_mask_mods(rank, world, cases):
    """Arbitrary mask_mods (prefix-LM, chunked), GQA, soft-capping; q/k/v leaves as buffers; exact."""
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(2, h, SEQ, 8, generator=gen, dtype=torch.float64) for h in (6, 1, 1)]  # MQA
    dout = torch.randn(2, 6, SEQ, 8, generator=gen, dtype=torch.float64)
    for mod, softcap in ((_prefix_lm, None), (_chunked, 2.0), (_dilated, None)):
        keep = create_mask(mod, 1, 1, SEQ, SEQ, device="cpu")
        leaves = [t.clone().requires_grad_() for t in full]
        out_ref = _softmax_reference(*leaves, keep, softcap)
        out_ref.backward(dout)
        exact = [out_ref.detach(), *(t.grad for t in leaves)]
        score_mod = None if softcap is None else _gemma_softcap  # written by hand: recognised by probing
        for strategy, mesh, layout in cases:
            q, k, v = (t.float().requires_grad_() for t in full)
            mask = create_block_mask(mod, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
            local_dout = dout[:, :, shard_index(layout, world, rank, SEQ)].float()
            with context_parallel(
                mesh, buffers=(q, k, v, mask), buffer_seq_dims=(2, 2, 2, 0), strategy=strategy, layout=layout
            ):
                out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
                out.backward(local_dout)
            got = [context_parallel_unshard(mesh, [out], [2], layout=layout)[0], q.grad, k.grad, v.grad]
            for name, g, e in zip(("out", "dq", "dk", "dv"), got, exact):
                what = f"{mod.__name__} P={world} {strategy} {layout} {name}"
                torch.testing.assert_close(g, e.float(), **FP32, msg=what)


def _check_torch_door(rank, world, mesh):
    """torch's own flex_attention inside the block (no grad: on the CPU torch refuses grad first) is refused
    with a message that names seqpar's import, on every rank, and the block leaves nothing behind."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, SEQ, 8, generator=gen) for _ in range(3))
    mask = create_block_mask(_mask_mods()["sliding"], 2, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    block = context_parallel(mesh, buffers=(q, k, v, mask), buffer_seq_dims=(2, 2, 2, 0))
    with pytest.raises(Exception, match="from seqpar import flex_attention"), torch.no_grad(), block:
        torch_flex_attention(q, k, v, block_mask=mask, scale=0.3)
    assert q.shape[2] == SEQ and mask.shape[-1] == SEQ, "not restored"
    out = torch_flex_attention(q, k, v, block_mask=mask, scale=0.3)  # outside the block: torch's, untouched
    assert out.shape == q.shape


def _check_negative_control(rank, world, mesh):
    """The rule inside PARTIAL blocks is what makes it exact: with it switched off (every pair of a PARTIAL
    block visible) the same call must differ from the reference."""
    gen = torch.Generator().manual_seed(6)
    full = [torch.randn(1, 2, SEQ, 8, generator=gen) for _ in range(3)]
    keep = create_mask(_prefix_lm, 1, 1, SEQ, SEQ, device="cpu")
    reference = _softmax_reference(*(t.double() for t in full), keep, None).float()
    index = shard_index("zigzag", world, rank, SEQ)
    local = [t[:, :, index] for t in full]
    block = create_block_mask(_prefix_lm, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    with context_parallel(mesh, buffers=(block,), buffer_seq_dims=(0,)):
        served = flex_attention(*local, block_mask=block)
    torch.testing.assert_close(served, reference[:, :, index], **FP32, msg="served")
    rule = blockwise_mask(block, 1)
    off = BlockwiseMask(
        rule.length, rule.block, rule.kinds, lambda q0, q1, k0, k1: torch.ones(1, q1 - q0, k1 - k0, dtype=torch.bool)
    )
    broken = seqpar.attention(*local, mesh=mesh, causal=False, mask=SequenceMask(predicate=off), strategy="allgather")
    assert not torch.allclose(broken, reference[:, :, index], **FP32), "the check cannot see the rule"


def _key_padding() -> torch.Tensor:
    """``[2, SEQ]`` keys seen: row 0 loses its last 9 (a text's padding), row 1 scattered keys and a whole
    zigzag chunk at P = 2 and 3 (tokens 16-23), so some ranks hold chunks with no key seen."""
    valid = torch.ones(2, SEQ, dtype=torch.bool)
    valid[0, -9:] = False
    valid[1, torch.tensor([0, 3, 5, 11, 30, 31, 47])] = False
    valid[1, 16:24] = False
    return valid


def _check_key_padding(rank, world, cases):
    """SDPA with a boolean key-padding ``attn_mask`` over the shard's keys (the mask a buffer sharded with the
    tokens), GQA, non-causal: outputs and q/k/v gradients against float64 masked softmax."""
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(2, h, SEQ, 8, generator=gen, dtype=torch.float64) for h in (6, 2, 2)]
    dout = torch.randn(2, 6, SEQ, 8, generator=gen, dtype=torch.float64)
    keep = _key_padding()[:, None, None, :]
    leaves = [t.clone().requires_grad_() for t in full]
    out_ref = _softmax_reference(*leaves, keep, None)
    out_ref.backward(dout)
    exact = [out_ref.detach(), *(t.grad for t in leaves)]
    for strategy, mesh, layout in cases:
        q, k, v = (t.float().requires_grad_() for t in full)
        valid = _key_padding()
        local_dout = dout[:, :, shard_index(layout, world, rank, SEQ)].float()
        with context_parallel(
            mesh, buffers=(q, k, v, valid), buffer_seq_dims=(2, 2, 2, 1), strategy=strategy, layout=layout
        ):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)
            out.backward(local_dout)
        got = [context_parallel_unshard(mesh, [out], [2], layout=layout)[0], q.grad, k.grad, v.grad]
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, exact):
            what = f"key padding P={world} {strategy} {layout} {name}"
            torch.testing.assert_close(g, e.float(), **FP32, msg=what)


def _check_key_padding_control(rank, world, mesh):
    """Without the gathered mask (each rank's keys all seen) the same call differs from the reference; a row
    whose keys are all hidden is refused on every rank."""
    gen = torch.Generator().manual_seed(8)
    full = [torch.randn(2, 2, SEQ, 8, generator=gen) for _ in range(3)]
    valid = _key_padding()
    reference = _softmax_reference(*(t.double() for t in full), valid[:, None, None, :], None).float()
    index = shard_index("zigzag", world, rank, SEQ)
    local = [t[:, :, index] for t in full]
    unmasked = seqpar.attention(*local, mesh=mesh, causal=False, strategy="ring")
    assert not torch.allclose(unmasked, reference[:, :, index], **FP32), "the check cannot see the mask"
    hidden = valid.clone()
    hidden[1] = False
    with (
        pytest.raises(SeqparInputError, match=r"hides every key of batch rows \[1\]"),
        context_parallel(mesh, buffers=(hidden,), buffer_seq_dims=(1,)),
    ):
        F.scaled_dot_product_attention(*local, attn_mask=hidden[:, None, None, :])


def _worker(rank, world, part):
    mesh = init_device_mesh("cpu", (world,))
    if part == "hybrid":  # the two-axis hybrid: ulysses 2 x ring 2
        _check_mask_mods(rank, world, [("hybrid", seqpar.make_mesh(ulysses_size=2), "zigzag")])
        _check_key_padding(rank, world, [("hybrid", seqpar.make_mesh(ulysses_size=2), "zigzag")])
        return
    hybrid = seqpar.make_mesh(ulysses_size=world if world == 2 else 1)  # one axis of size 1 at P = 2, 3
    cases = [(s, mesh, "zigzag") for s in ("ring", "allgather", "ulysses")]
    cases += [("hybrid", hybrid, "zigzag"), ("ring", mesh, "contiguous")]
    if part == "model":
        _check_model(rank, world, cases[:4])
    else:
        _check_mask_mods(rank, world, cases)
        _check_recognition()
        _check_torch_door(rank, world, mesh)
        _check_negative_control(rank, world, mesh)
        _check_key_padding(rank, world, [*cases, ("allgather", mesh, "contiguous"), ("ulysses", mesh, "contiguous")])
        _check_key_padding_control(rank, world, mesh)


PARTS = [pytest.param(w, p, id=f"P{w}-{p}") for w in (2, 3) for p in ("model", "masks")]
PARTS.append(pytest.param(4, "hybrid", id="P4-hybrid"))


@pytest.mark.parametrize(("world", "part"), PARTS)
def test_flex_matches_one_process(world, part):
    run_ranks(world, _worker, part)


def _alibi(score, b, h, q_idx, kv_idx):
    return score - (q_idx - kv_idx).abs()


def _flex_in_block(mesh, buffers, dims, qkv=None, **kwargs) -> None:
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims):
        if qkv is not None:
            flex_attention(*qkv, **kwargs)


def _local_mask_in_block(mesh, q, k, v) -> None:
    with context_parallel(mesh, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2)):
        local = create_block_mask(_chunked, None, None, q.shape[2], q.shape[2], device="cpu", BLOCK_SIZE=BLOCK)
        flex_attention(q, k, v, block_mask=local)


def _bad_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, SEQ, 8, generator=gen) for _ in range(3))
    block = create_block_mask(_chunked, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    held = dict(buffers=(q, k, v, block), dims=(2, 2, 2, 0))
    # an unsupported score_mod on one rank only (soft-capping on the other): every rank raises, nothing hangs
    score_mod = _alibi if rank == 0 else softcap_score_mod(5.0)
    with pytest.raises(seqpar.SeqparInputError, match="score_mod is not served"):
        _flex_in_block(mesh, **held, qkv=(q, k, v), score_mod=score_mod, block_mask=block)
    assert q.shape[2] == SEQ and block.shape[-1] == SEQ and block.mask_mod is _chunked, "not restored"
    with pytest.raises(seqpar.SeqparInputError, match="built on the shards"):  # on the shards' local indices
        _local_mask_in_block(mesh, q, k, v)
    per_head = create_block_mask(_chunked, None, 2, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    with pytest.raises(seqpar.SeqparInputError, match="depends on the head"):
        _flex_in_block(mesh, (q, per_head), (2, 0))
    short = create_block_mask(_chunked, None, None, SEQ // 2, SEQ // 2, device="cpu", BLOCK_SIZE=BLOCK)
    with pytest.raises(seqpar.SeqparInputError, match="does not cover"):
        _flex_in_block(mesh, (q, short), (2, 0))
    with pytest.raises(seqpar.SeqparInputError, match="return_lse"):
        _flex_in_block(mesh, **held, qkv=(q, k, v), block_mask=block, return_lse=True)
    assert q.shape[2] == SEQ and block.shape[-1] == SEQ, "not restored after the refusals"


def test_flex_bad_input_raises_on_every_rank():
    run_ranks(2, _bad_worker)  # every refusal is agreed before any collective: nothing hangs
