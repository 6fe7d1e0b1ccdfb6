"""The own training loop under the placed layout: packed rows reordered and padded, against one process.

Run inside the spawns of tests/test_transformers.py (no spawn of their own).
"""

from __future__ import annotations

import copy
import itertools

import torch

import seqpar
from tests._models import build, documents_alone_history, tokens

__all__ = ["check_placed_training"]

# Two packed rows (the micro-batches of a step) of uneven documents, 45 and 47 tokens: the placed layout reorders
# both, and pads both at 2 ranks and the second at 3 (test_placement.py checks the solver itself).
DOCUMENTS = [(9, 3, 17, 11, 5), (5, 29, 13)]
STEPS, LR, MAX_NORM = 3, 1.0, 0.5  # plain SGD: a gradient scaled on some elements moves those parameters by that much
ATOL, RTOL = 2e-5, 1e-4  # logits
LOSS_TOL = dict(atol=1e-6, rtol=1e-5)  # per-step loss and gradient norm
# parameters after the SGD steps, whose steps are linear in the gradient (no Adam: Note [AdamW floors]): one fp32
# process (eager or SDPA attention) is 59 times inside this bound of the same steps in float64, entry by entry
PARAM_TOL = dict(atol=1e-6, rtol=1e-4)


def _rows(step: int) -> list[torch.Tensor]:
    """The token ids of ``step``'s micro-batches, one packed row each."""
    return [tokens(1, sum(docs), 30 + 2 * step + i)[0] for i, docs in enumerate(DOCUMENTS)]


def _alone(model) -> list[torch.Tensor]:
    """Step 0's logits ``[1, S, V]`` of each row, every document run by itself."""
    with torch.no_grad():
        return [
            torch.cat(
                [model(input_ids=row[None, end - n : end]).logits for end, n in zip(itertools.accumulate(d), d)], 1
            )
            for row, d in zip(_rows(0), DOCUMENTS)
        ]


def _run(model, mesh, layout: str, alone: list[torch.Tensor], what: str) -> torch.Tensor:
    """The own loop: SGD steps on this rank's placed shards; per-step (loss, gradient norm) of the whole step."""
    positions = [torch.cat([torch.arange(n) for n in docs])[None] for docs in DOCUMENTS]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        batches = [{"input_ids": r[None], "position_ids": p} for r, p in zip(_rows(step), positions)]
        shards = [seqpar.shard_batch(b, mesh, layout=layout) for b in batches]
        total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], mesh)
        assert total == sum(n - 1 for docs in DOCUMENTS for n in docs), (what, total)  # padding predicts nothing
        assert any(bool((s.placement.order < 0).any()) for s in shards), what  # a placed row is padded
        step_loss = torch.zeros(())
        for batch, shard, want in zip(batches, shards, alone):
            order = shard.placement.order[0]
            assert shard.layout.name == "placed", (what, shard.layout)
            assert not torch.equal(order[order >= 0], torch.arange(batch["input_ids"].shape[1])), what  # reordered
            call = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
            logits = model(**call, seqpar_layout=shard.layout).logits
            if step == 0:  # the gathered placed row, put back in the batch's order: every document alone
                full = seqpar.gather_sequence(logits.detach(), mesh, layout=shard.layout)
                got = shard.placement.restore(full, want.shape[1])
                torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} logits: {m}")
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
            loss.backward()
            step_loss += loss.detach()
        seqpar.reduce_gradients(model.parameters(), mesh)
        norm = seqpar.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        history.append(torch.stack([seqpar.sum_over(step_loss, mesh), norm]))
    return torch.stack(history)


def check_placed_training(rank: int, world_size: int, mesh) -> None:
    """Tiny Llama, 3 SGD steps with clipping, two packed micro-batches per step under ``layout="placed"`` (and
    ``"auto"``, which resolves to it on packed rows): the step-0 logits, per-step loss and gradient norm, and the
    parameters after the steps equal one process running every document alone. Ring, all-gather, and Ulysses
    where the 4 heads split."""
    ref = build("llama").train()
    alone = _alone(ref)
    reference = copy.deepcopy(ref)
    want = documents_alone_history(reference, _rows, DOCUMENTS, STEPS, LR, MAX_NORM)
    assert (want[:, 1] > MAX_NORM).all(), "clipping must be active for this test to mean anything"
    runs = [("ring", "placed"), ("allgather", "auto")] + ([("ulysses", "placed")] if 4 % world_size == 0 else [])
    for strategy, layout in runs:
        what = f"{strategy} layout={layout} P={world_size}"
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy=strategy, layout=layout).train()
        got = _run(model, mesh, layout, alone, what)
        torch.testing.assert_close(got, want, **LOSS_TOL, msg=lambda m, w=what: f"{w} (loss, grad norm) per step: {m}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, **PARAM_TOL, msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
