"""Hybrid models' token mixers other than attention under seqpar (Note [mixer adapters]): LFM2's short convolution,
the gated DeltaNet of Qwen3-Next, Qwen3.5 and Olmo-Hybrid, the Mamba2 layers of GraniteMoeHybrid, Bamba and
Falcon-H1, the Mamba1 layers of Jamba, Mamba and Falcon-Mamba and RecurrentGemma's RG-LRU blocks (their
convolutions and recurrent states passed between ranks).

Logits, loss and every parameter's gradient equal one process (unpacked rows) and each packed document run alone
(documents of 1 and 2 tokens, shorter than the convolution, a boundary on a chunk edge, a document starting in
a chunk's last tokens, one spanning several chunks, a rank whose chunks all start documents), at P = 1, 2, 3,
in the zigzag, contiguous, balanced and (packed) placed layouts; with checkpointing, under bf16 autocast, on the
hybrid mesh; over 3 AdamW steps; without the exchanges the same checks fail; bad input is refused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.models import FAMILIES, anatomy, register_family
from seqpar.models.families import UNSERVED
from seqpar.sequence_parallel import mixers
from seqpar.sequence_parallel.mixers import conv, scan
from tests._dist import run_ranks, shard_index
from tests._floors import StepFloors, assert_near_float64, gradients
from tests._models import tiny_config

SEQ, VOCAB = 48, 96  # tests._models' vocabulary
LOGITS_RTOL, LOSS_ATOL = 1e-6, 1e-6  # logits: of the largest logit when it is above 1
GRAD_RTOL = 1e-5  # of each tensor's largest entry
FLOOR_LIMIT = 10.0  # the fallback's one-process distance from float64, at most, in units of the bound
FLOOR_FACTOR = 4.0
"""How far past the rounding floor seqpar may be, as "4x the noise" of one process that sums in another order:
logits past ``LOGITS_RTOL`` and a gradient past ``GRAD_RTOL`` of one fp32 process pass within this factor of that
process's own distance from the float64 model. Rounding alone puts one fp32 process that far: its logits are up to
2.4e-6 of the largest logit from float64 (Falcon-H1, Zamba2; seqpar at P = 3 1.9e-6 and 2.1e-6), and where a
tensor's entries cancel its gradient too (Zamba2's ``D`` at P = 3: one process 6.3e-6 of its largest entry from
float64, seqpar 6.4e-6, in opposite directions, so 1.25e-5 from each other). The parameters after AdamW steps
(``_adamw``) are judged entry by entry against float64 (Note [AdamW floors], tests/_floors.py)."""
# starts 0, 1, 3, 8 (a chunk edge at P = 3 zigzag), 14 (two tokens before the next edge, 16), 40 (the start of rank
# 0's second chunk at P = 3: both its chunks start documents); 1 and 2 tokens are shorter than the width-3 kernel
DOCUMENTS = (1, 2, 5, 6, 26, 8)


KINDS = (
    "lfm2", "qwen3_next", "qwen3_5", "olmo_hybrid", "granitemoehybrid", "bamba", "falcon_h1", "nemotron_h", "mamba2",
    "zamba2", "kimi_linear", "mamba", "falcon_mamba", "jamba", "minimax", "recurrent_gemma",
)  # fmt: skip


@functools.cache
def _built(kind: str, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """``kind``'s tiny model built from ``seed`` (never run: ``_model`` hands out copies) and the random state the
    build leaves behind."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager").eval()
    for module in model.modules():  # weak decay: the state a chunk hands on matters, so a missing exchange shows
        if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
            module.A_log.data.fill_(math.log(0.02))
    return model, torch.get_rng_state()


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A fresh copy of ``kind``'s tiny model, built once per process; the random state set as the build leaves it,
    so what is drawn next (LoRA's initial weights) is the same on every rank whatever it ran before."""
    model, state = _built(kind, seed)
    torch.set_rng_state(state)
    return copy.deepcopy(model)


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _one_process(ref: torch.nn.Module, ids: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and loss of one process (each document alone when packed), gradients left in ``ref``."""
    if not packed:
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach()
    valid = sum(n - 1 for n in DOCUMENTS)
    logits, loss, start = [], torch.zeros(()), 0
    for n in DOCUMENTS:
        piece = ids[:, start : start + n]
        out = ref(input_ids=piece, labels=piece if n > 1 else None)
        if n > 1:
            share = out.loss * (n - 1) / valid
            share.backward()
            loss += share.detach()
        logits.append(out.logits.detach())
        start += n
    return torch.cat(logits, 1), loss


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64, its experts (if any) in transformers' eager loop (grouped matmuls take no float64)."""
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model.double()


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]  # an expert unchosen


@functools.cache
def _float64_run(kind: str, packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The float64 model's logits and every parameter's gradient on ``_check``'s batch, as ``_one_process`` makes
    them (zeros where none); made once per process, as every layout and strategy compares with the same."""
    exact = _float64(_model(kind))
    logits, _ = _one_process(exact, _ids(1 if packed else 2, 3), packed)
    return logits, _gradients(exact)


Reference = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]
_REFERENCES: dict[tuple[str, bool], Reference] = {}
"""One fp32 process's runs on ``_check``'s batches, by (kind, packed): every layout and strategy compares with the
same, so each is made once per rank process (or once per group, ``_share_references``)."""


def _reference(kind: str, packed: bool) -> Reference:
    """One fp32 process's logits, loss and every parameter's gradient (zeros where none) on ``_check``'s batch."""
    if (kind, packed) not in _REFERENCES:
        ref = _model(kind)
        logits, loss = _one_process(ref, _ids(1 if packed else 2, 3), packed)
        _REFERENCES[kind, packed] = logits, loss, _gradients(ref)
    return _REFERENCES[kind, packed]


def _mapped(obj, convert):
    """``obj`` with ``convert`` applied to each leaf of its dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {key: _mapped(value, convert) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_mapped(value, convert) for value in obj)
    return convert(obj)


def _everyones(mine: dict, world_size: int) -> dict:
    """Every rank's ``mine`` (a dict of tensors, in dicts, lists and tuples) merged, on every rank; the tensors travel
    as numpy arrays (``all_gather_object`` pickles a tensor by ``torch.save``, slowly for thousands of small ones)."""
    everyone: list[dict] = [{}] * world_size
    dist.all_gather_object(everyone, _mapped(mine, lambda t: t.detach().numpy() if torch.is_tensor(t) else t))
    merged = {key: value for part in everyone for key, value in part.items()}
    return _mapped(merged, lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a)


def _share_references(rank: int, world_size: int, kinds=KINDS, packings=(False, True)) -> None:
    """Make the references ``_check`` will read once over the group instead of on every rank: each rank makes every
    ``world_size``-th of them, then every rank takes them all (one process's run is the same wherever it runs)."""
    pairs = [(kind, packed) for kind in kinds for packed in packings]
    mine = {pair: _reference(*pair) for i, pair in enumerate(pairs) if i % world_size == rank}
    _REFERENCES.update(_everyones(mine, world_size))


def _close_or_at_floor(found: torch.Tensor, want: torch.Tensor, truth_of, bound: float, what: str) -> None:
    """``found`` within ``bound`` of one fp32 process's ``want``, or (past it) within ``FLOOR_FACTOR`` times that
    process's own distance from the float64 model's value, ``truth_of()``. The fallback holds only where that distance
    is rounding, at most ``FLOOR_LIMIT`` times the bound: a float64 run that strays further (an expert chosen
    otherwise) is no floor, and the check fails."""
    if float((found - want).abs().max()) <= bound:
        return
    truth = truth_of().double()  # NemotronH returns float32 logits whatever its parameters' dtype
    own = float((want.double() - truth).abs().max())  # how far rounding alone puts one fp32 process
    assert own <= FLOOR_LIMIT * bound, f"{what}: past {bound:.1e}, and one process is {own:.1e} from float64"
    atol = FLOOR_FACTOR * own + 1e-8
    torch.testing.assert_close(found.double(), truth, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def _check(rank, world_size, mesh, kind, layout, packed, strategy="ring", checkpointing=False):
    ids = _ids(1 if packed else 2, 3)
    want_logits, want_loss, want_grads = _reference(kind, packed)
    model = _model(kind)
    if checkpointing:  # the layers run again in the backward, their exchanges with them, on every rank alike
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    model = seqpar.prepare_model(model, mesh, strategy=strategy)
    batch = {"input_ids": ids}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    shard = seqpar.shard_batch(batch, mesh, layout=layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], seqpar_layout=shard.layout).logits
    loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
    loss.backward()
    seqpar.reduce_gradients(model.parameters(), mesh)
    what = f"{kind} {layout} {'packed' if packed else 'rows'} {strategy} P={world_size} checkpointing={checkpointing}"
    if shard.placement is not None:  # the placed row: each token's index in the batch's row, -1 for padding
        order = shard.placement.order[:, shard_index(shard.layout, world_size, rank, shard.placement.seq_len)]
        keep = order >= 0
        got = logits[keep]

        def mine(full: torch.Tensor) -> torch.Tensor:  # this rank's tokens of a whole row's logits
            return full[0, order[keep]]
    else:
        idx = shard_index(shard.layout, world_size, rank, SEQ)
        got = logits

        def mine(full: torch.Tensor) -> torch.Tensor:
            return full[:, idx]

    def exact() -> tuple[torch.Tensor, list[torch.Tensor]]:  # made once per family and batch, when needed
        return _float64_run(kind, packed)

    scale = max(1.0, float(want_logits.abs().max()))  # the largest logit, when above 1
    bound = LOGITS_RTOL * scale
    _close_or_at_floor(got.detach(), mine(want_logits), lambda: mine(exact()[0]), bound, f"{what} logits")
    total = seqpar.sum_over(loss.detach(), mesh)
    torch.testing.assert_close(total, want_loss, atol=LOSS_ATOL, rtol=0, msg=lambda m: f"{what} loss: {m}")
    for index, ((name, p), want) in enumerate(zip(model.named_parameters(), want_grads, strict=True)):
        found = p.grad if p.grad is not None else torch.zeros_like(p)  # an expert no token chose
        bound = GRAD_RTOL * float(want.abs().max()) + 1e-8
        _close_or_at_floor(found, want, lambda i=index: exact()[1][i], bound, f"{what} {name}")


EVERY_LAYOUT = ("lfm2", "qwen3_next", "granitemoehybrid", "kimi_linear", "mamba", "minimax", "recurrent_gemma")
"""One family per adapter (short convolution, gated DeltaNet, Mamba2, KDA, Mamba1, lightning attention, RG-LRU) runs
every layout packed and not at P = 2, and contiguous and balanced packed at P = 3: the layouts change which chunks a
rank's exchange composes, which the adapter does the same for each of its families; the other families (their own
anatomy on the same adapter) run zigzag both ways and balanced packed at P = 2. Every family runs zigzag both ways at
P = 3 (odd chunk splits; ``DOCUMENTS``' edges), and the placed layout and packed rows under another attention strategy
at P = 2 and 3 (Ulysses at 2, beside ring; all-gather at 3, its packed zigzag run): the mixers exchange over the whole
group whatever the attention does. At P = 1 one rank holds the row, which every layout leaves whole in one chunk: zigzag
runs it packed and not."""


@contextlib.contextmanager
def _counted_conv_kernel(kind: str):
    """Wrap the ``causal_conv1d_fn`` of ``kind``'s modeling module, while the block runs, to count seqpar's calls
    of it (yields ``[calls]``, updated in place; the one-process reference's own calls are not counted, and the
    module gets its own function back, as the ranks serve later tests); a family without a convolution yields
    None."""
    module = sys.modules[type(anatomy(_model(kind)).mixers[0]).__module__]
    kernel = getattr(module, "causal_conv1d_fn", None)
    if kernel is None:
        yield None
        return
    calls = [0]

    @functools.wraps(kernel)
    def counted(*args, **kwargs):
        calls[0] += sys._getframe(1).f_code is conv.halo_causal_conv.__code__
        return kernel(*args, **kwargs)

    module.causal_conv1d_fn = counted
    try:
        yield calls
    finally:
        module.causal_conv1d_fn = kernel


def _runs(kind: str, world_size: int) -> list[tuple[str, bool, str]]:
    """``kind``'s (layout, packed, strategy) runs at ``world_size`` (see ``EVERY_LAYOUT``)."""
    if world_size == 1:  # one rank holds the row: every layout is the same row (one chunk, attention local)
        return [("zigzag", False, "ring"), ("zigzag", True, "ring")]
    if world_size == 2:
        runs = [
            (layout, packed, "ring")
            for layout in ("zigzag", "contiguous", "balanced")
            for packed in (False, True)
            if kind in EVERY_LAYOUT or layout == "zigzag" or (layout == "balanced" and packed)
        ]
        # the mixers exchange over the whole group whatever the attention does
        return [*runs, ("zigzag", True, "ulysses"), ("placed", True, "ring")]
    # odd splits: zigzag both ways, its packed row (DOCUMENTS' edges) under all-gather attention
    runs = [("zigzag", False, "ring"), ("zigzag", True, "allgather")]
    if kind in EVERY_LAYOUT:
        runs += [("contiguous", True, "ring"), ("balanced", True, "ring")]
    return [*runs, ("placed", True, "ring")]  # packed documents reordered so that short ones stay whole


def _exact(rank, world_size):
    """Each family's ``_runs``; the halo convolution runs the model's own ``causal_conv1d_fn`` on whole rows
    (zigzag), and its masked taps on packed rows (Note [halo convolution])."""
    mesh = seqpar.make_mesh()
    _share_references(rank, world_size)
    for kind in KINDS:
        with _counted_conv_kernel(kind) as calls:
            for layout, packed, strategy in _runs(kind, world_size):
                before = calls and calls[0]
                _check(rank, world_size, mesh, kind, layout, packed, strategy)
                if calls is not None and layout != "placed" and (layout == "zigzag" or packed):
                    assert (calls[0] > before) == (not packed), (kind, layout, packed, calls)


# MLA attention only (values of another head size): SDPA runs the same arithmetic as eager on the CPU (measured: equal)
_SDPA_SUMS_AS_EAGER = ("kimi_linear",)


def _rounding_twin(ref: torch.nn.Module, kind: str) -> torch.nn.Module:
    """One process again, summing in another order: SDPA instead of eager attention, for a model without attention
    the scan's own chunks halved (Mamba2), and where SDPA sums as eager does or the scan has no chunks (Mamba1),
    the model in float64."""
    other, mixers = copy.deepcopy(ref), anatomy(ref).mixers
    if kind in _SDPA_SUMS_AS_EAGER:
        _float64(other)
    elif any(m is not None for m in anatomy(other).attention):
        other.set_attn_implementation("sdpa")
    elif all(hasattr(m, "chunk_size") for m in mixers):
        for mixer in anatomy(other).mixers:
            mixer.chunk_size //= 2
    else:  # Mamba1's scan runs token by token
        _float64(other)
    return other


def _autocast(rank, world_size, kind):
    """Under bf16 autocast (the kernels keep their states in fp32) the logits are one process's under autocast to
    within 4 times the bf16 floor: how far a second one-process run (``_rounding_twin``) is (measured
    0.6-1.1% of the largest logit, seqpar 0.4-2.1% on either rank)."""
    mesh = seqpar.make_mesh()
    ref, ids = _model(kind), _ids(2, 3)
    other = _rounding_twin(ref, kind)
    model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want, alt = ref(input_ids=ids).logits.float(), other(input_ids=ids).logits.float()
        got = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits.float()
    idx = shard_index("zigzag", world_size, rank, SEQ)
    floor, found = float((alt - want).abs().max()), float((got - want[:, idx]).abs().max())
    assert floor > 0 and found <= 4 * floor, (kind, floor, found)


def _composition(rank, world_size):
    """Activation checkpointing (the layers and their exchanges recomputed in the backward) and bf16 autocast at P = 2,
    and the hybrid mesh (ulysses 2 x ring 2: the mixers exchange over the whole group) at P = 4."""
    _share_references(rank, world_size, packings=(True,))
    if world_size == 2:
        for kind in KINDS:
            _check(rank, world_size, seqpar.make_mesh(), kind, "zigzag", True, checkpointing=True)
            _autocast(rank, world_size, kind)
    else:
        for kind in KINDS:
            _check(rank, world_size, seqpar.make_mesh(ulysses_size=2), kind, "zigzag", True, strategy="hybrid")


_ADAMW_RUNS = ("float64", "one process", "twin", "halves")
"""``_adamw``'s one-process runs: run i is made on rank i mod P, and the floors' replay on rank 4 mod P."""


def _adamw_run(name: str, ref: torch.nn.Module, exact: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The model of ``_ADAMW_RUNS``' run ``name``, made before ``ref`` (one process) trains."""
    if name == "float64":
        return exact
    if name == "one process":
        return ref
    return _rounding_twin(ref, kind) if name == "twin" else copy.deepcopy(ref)


def _adamw_step(name: str, run: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor | None, list]:
    """One of ``_ADAMW_RUNS`` forward and backward on ``ids``: its loss (None for "halves") and its gradients."""
    if name != "halves":
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), gradients(run)
    # the tokens' sums split in two, as seqpar splits them by rank: each half's share of the loss backward
    ce = torch.nn.functional.cross_entropy(
        run(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
    ).view(len(ids), -1)
    cut = ce.shape[1] // 2
    (ce[:, :cut].sum() / ce.numel()).backward(retain_graph=True)
    (ce[:, cut:].sum() / ce.numel()).backward()
    return None, gradients(run)


def _adamw(rank, world_size, kinds=KINDS, losses=True):
    """3 AdamW steps on fresh unpacked rows: every step's loss within 1e-5 of one process's, and every parameter
    entry within ``FLOOR_FACTOR`` times its rounding floor of the float64 model's after the same steps (Note [AdamW
    floors]: the gradients' rounding measured per tensor and step from one process, ``_rounding_twin`` and one
    process summing the tokens' gradients in two halves, carried through the replayed AdamW steps). Adam moves an
    entry by about lr whatever its gradient's size, so rounding in a tiny gradient becomes a step (Mamba2's second
    convolution bias: one gradient entry 4e-7 of the largest), and which entries it hits depends on the order of
    the sums: a floor from two fp32 runs' distances passed here and failed on another CPU (issue 57). The
    one-process runs (``_ADAMW_RUNS``) are shared out over the ranks, each step's losses and gradients then taken by
    every rank, as are the float64 parameters and the floors after the steps. Returns the least margin (bound /
    distance) of seqpar's entries. ``losses`` False leaves the losses unchecked (the negative control: the
    parameters' check alone must fail)."""
    mesh = seqpar.make_mesh()
    margin = math.inf
    mine = [name for i, name in enumerate(_ADAMW_RUNS) if i % world_size == rank]
    replays = len(_ADAMW_RUNS) % world_size == rank
    for kind in kinds:
        ref = _model(kind).train()
        exact = _float64(copy.deepcopy(ref))  # on every rank: the floors start from it, the steps' result lands in it
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
        runs = {name: _adamw_run(name, ref, exact, kind) for name in mine}

        def adamw(params):
            return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)

        floors = StepFloors(exact, adamw)
        opts = [adamw(m.parameters()) for m in (*runs.values(), model)]
        for step in range(3):
            ids = _ids(2, 10 + step)
            stepped = _everyones({name: _adamw_step(name, run, ids) for name, run in runs.items()}, world_size)
            shard = seqpar.shard_batch({"input_ids": ids}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
            loss.backward()
            seqpar.reduce_gradients(model.parameters(), mesh)
            got = seqpar.sum_over(loss.detach(), mesh)
            if losses:
                message = f"{kind} step {step} loss"
                want = stepped["one process"][0]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, w=message: f"{w}: {m}")
            floors.record(stepped["float64"][1], [stepped[name][1] for name in _ADAMW_RUNS[1:]])
            for opt in opts:
                opt.step()
                opt.zero_grad()
        ends = {"float64": list(exact.parameters())} if "float64" in runs else {}
        ends = _everyones(ends | ({"floors": floors.floors()} if replays else {}), world_size)
        with torch.no_grad():
            for p, q in zip(exact.parameters(), ends["float64"], strict=True):
                p.copy_(q)
        found = assert_near_float64(model.named_parameters(), exact, ends["floors"], f"{kind} after 3 AdamW steps")
        margin = min(margin, found)
    return margin


def _control(rank, world_size):
    """Without the exchange (halos and incoming states zero) logits, the mixers' gradients and the parameters after
    AdamW steps are far off: the checks can tell."""
    mesh = seqpar.make_mesh()
    _share_references(rank, world_size, packings=(False,))
    kept = conv.gather_sequence

    def nothing_from_the_others(x, mesh, dim, layout):  # every rank's pieces gathered, then zeroed: no exchange
        return torch.zeros_like(kept(x, mesh, dim=dim, layout=layout))

    conv.gather_sequence = scan.gather_sequence = nothing_from_the_others
    try:
        for kind in KINDS:
            with pytest.raises(AssertionError, match=kind):
                _check(rank, world_size, mesh, kind, "zigzag", False)
            model = seqpar.prepare_model(_model(kind), mesh, strategy="ring")
            want, _, want_grads = _reference(kind, False)
            shard = seqpar.shard_batch({"input_ids": _ids(2, 3)}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            seqpar.cross_entropy(logits, shard["shift_labels"], mesh).backward()
            seqpar.reduce_gradients(model.parameters(), mesh)
            idx = shard_index("zigzag", world_size, rank, SEQ)
            off = torch.tensor(float((logits - want[:, idx]).abs().max()))
            seqpar.sum_over(off, mesh)
            assert float(off) > 1e-2, (kind, float(off))
            mixers = tuple(f"{anatomy(model).name(m)}." for m in anatomy(model).mixers)
            worst = max(
                float((p.grad - q).abs().max() / q.abs().max())
                for (n, p), q in zip(model.named_parameters(), want_grads, strict=True)
                if n.startswith(mixers)
            )
            assert worst > 0.1, (kind, worst)
        with pytest.raises(AssertionError, match="LoRA"):  # the LoRA check sees it too
            _lora(rank, world_size, kinds=("qwen3_next",))
        with pytest.raises(AssertionError, match="after 3 AdamW steps"):  # and the parameters' floors after AdamW
            _adamw(rank, world_size, kinds=("qwen3_next",), losses=False)
    finally:
        conv.gather_sequence = scan.gather_sequence = kept


def _refused_calls(rank, world_size, mesh):
    """A hybrid model's calls that seqpar cannot serve, each refused on every rank before any exchange: a cache, a
    padding mask, a whole row's varlen boundaries next to the position ids, and ranks whose configs differ."""
    model = seqpar.prepare_model(_model("qwen3_next"), mesh)
    shard = seqpar.shard_batch({"input_ids": _ids(1, 3)}, mesh)
    call = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    lengths, first = torch.tensor([0, 20, SEQ], dtype=torch.int32), torch.tensor([0])
    refused = {
        "without a KV cache": {"use_cache": True},
        "drop attention_mask": {"attention_mask": torch.ones_like(call["input_ids"]).index_fill(1, first, 0)},
        "describe a whole row's packed documents": {"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths},
        "reads the documents from position_ids": {"seq_idx": torch.zeros_like(shard["input_ids"])},
    }
    for message, extra in refused.items():
        with pytest.raises(SeqparInputError, match=f"every rank: .*{message}"):
            model(**call, **extra)
    config = tiny_config("qwen3_next")
    config.linear_conv_kernel_dim = 4 + rank  # the halo's width, and the convolution's weights, differ by rank
    torch.manual_seed(0)
    other = seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(config), mesh)
    with pytest.raises(SeqparInputError, match=r"the ranks' models have different configs \(digests rank 0: "):
        other(**call)
    assert model(**call).logits.shape[1] == SEQ // world_size  # the refusals left nothing half-done


def _mismatched_mixers(mesh):
    """A mixer as another transformers version might build it (an attribute the adapter reads renamed, its module's
    kernel function gone) is refused by ``prepare_model``, naming what it lacks, before anything runs."""
    model = _model("qwen3_next")
    model.model.layers[0].linear_attn.time_bias = model.model.layers[0].linear_attn.dt_bias
    del model.model.layers[0].linear_attn.dt_bias
    with pytest.raises(SeqparInputError, match=r"Qwen3NextGatedDeltaNet lacks dt_bias \(transformers "):
        seqpar.prepare_model(model, mesh)
    module = sys.modules[type(_model("granitemoehybrid").model.layers[0].mamba).__module__]
    kernel = module.mamba2_chunk_scan
    del module.mamba2_chunk_scan
    try:
        lacks = rf"GraniteMoeHybridMambaLayer lacks {module.__name__}\.mamba2_chunk_scan"
        with pytest.raises(SeqparInputError, match=lacks):
            seqpar.prepare_model(_model("granitemoehybrid"), mesh)
    finally:
        module.mamba2_chunk_scan = kernel


def _bad_input(rank, world_size):
    mesh = seqpar.make_mesh()
    _refused_calls(rank, world_size, mesh)
    _mismatched_mixers(mesh)
    model = seqpar.prepare_model(_model("lfm2"), mesh)
    with pytest.raises(SeqparInputError, match="runs inside a prepared model's call"):  # a mixer called alone
        model.model.layers[0].conv(torch.randn(1, 4, 48))
    # an entry that does not declare a layer's token mixer (Falcon-H1's Mamba2 beside attention in every layer, the
    # entry edited to omit it) is refused, naming the module, its class and its layer: not run on each shard alone
    register_family(dataclasses.replace(FAMILIES["falcon_h1"], mixers=()), replace=True)
    try:
        with pytest.raises(SeqparInputError, match=r"model\.layers\.0\.mamba \(FalconH1Mixer\) in layer 0; model"):
            seqpar.prepare_model(_model("falcon_h1"), mesh)
    finally:
        register_family(dataclasses.replace(FAMILIES["falcon_h1"], mixers=("mamba",)), replace=True)
    # a model whose mixer class has no adapter (Falcon-Mamba's, its adapter taken out of the registry) is refused
    # with the mixer's name, before anything runs
    falcon_mamba = _model("falcon_mamba")
    adapters = dict(mixers.ADAPTERS)
    mixers.ADAPTERS.pop("FalconMambaMixer")
    try:
        with pytest.raises(SeqparInputError, match=r"FalconMambaMixer \(besides attention\) have no seqpar"):
            seqpar.prepare_model(falcon_mamba, mesh)
    finally:
        mixers.ADAPTERS.update(adapters)
    # a family listed as not served (and without an entry) is refused with its reason, before anything runs
    entry = FAMILIES.pop("falcon_mamba")
    UNSERVED["falcon_mamba"] = "a reason given here"
    try:
        refused = r"does not serve 'falcon_mamba' models \(FalconMambaForCausalLM\): a reason"
        with pytest.raises(SeqparInputError, match=refused):
            seqpar.prepare_model(falcon_mamba, mesh)
    finally:
        UNSERVED.pop("falcon_mamba")
        register_family(entry)


LORA_TARGETS = {
    "lfm2": ["in_proj", "out_proj"],
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    "granitemoehybrid": ["in_proj", "out_proj"],
    "kimi_linear": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mamba": ["in_proj", "x_proj"],  # PEFT refuses Mamba's out_proj (the fused CUDA path reads its weight)
    "minimax": ["qkv_proj", "output_gate", "out_proj"],
    "recurrent_gemma": ["linear_x", "linear_y", "linear_out"],
}
"""The projections LoRA adapts in each family of ``EVERY_LAYOUT``: its mixer's own (attention's where the names are
shared)."""


def _lora(rank, world_size, kinds=EVERY_LAYOUT):
    """PEFT LoRA on the mixers' projections (the adapted class keeps the module tree, so the adapters wrap the
    layers the adapted ``forward`` calls): one family per adapter, a packed row, logits and every LoRA gradient
    as one process's with the same adapters (within the bounds and float64 fallback of ``_check``)."""
    from peft import LoraConfig, get_peft_model

    mesh = seqpar.make_mesh()
    ids, positions = _ids(1, 3), torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    idx = shard_index("zigzag", world_size, rank, SEQ)
    for kind in kinds:
        # PEFT's own entry point: the wrapper's base model is the model itself, adapters injected, the rest frozen
        lora = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS[kind])
        ref = get_peft_model(_model(kind), lora).base_model.model
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():  # lora_B starts at zero: give it values, so that lora_A's gradient is not zero
            for name, p in ref.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        exact, model = _float64(copy.deepcopy(ref)), seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
        want, _ = _one_process(ref, ids, packed=True)
        truth, _ = _one_process(exact, ids, packed=True)
        shard = seqpar.shard_batch({"input_ids": ids, "position_ids": positions}, mesh)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        seqpar.cross_entropy(logits, shard["shift_labels"], mesh).backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        pairs = [("logits", logits.detach(), want[:, idx], truth[:, idx], LOGITS_RTOL * float(want.abs().max()))]
        every = zip(model.named_parameters(), ref.parameters(), exact.parameters(), strict=True)
        trained = [(n, p.grad, q.grad, e.grad) for (n, p), q, e in every if p.requires_grad]
        mixers = tuple(f"{anatomy(model).name(m)}." for m in anatomy(model).mixers)
        assert all("lora_" in n for n, *_ in trained) and any(n.startswith(mixers) for n, *_ in trained), kind
        pairs += [(n, found, one, ex, GRAD_RTOL * float(one.abs().max())) for n, found, one, ex in trained]
        for name, found, one, ex, bound in pairs:
            _close_or_at_floor(found, one, lambda ex=ex: ex, bound, f"{kind} LoRA {name}")


_PARTS = {
    "lora": _lora,
    "exact": _exact,
    "composition": _composition,
    "adamw": _adamw,
    "control": _control,
    "bad-input": _bad_input,
}


def _worker(rank, world_size, part):
    _PARTS[part](rank, world_size)


CASES = [(1, "exact"), (2, "exact"), (3, "exact"), (2, "composition"), (4, "composition"), (3, "adamw")]
CASES += [(2, "control"), (2, "bad-input"), (2, "lora")]


@pytest.mark.parametrize(
    ("world_size", "part"),
    CASES,
    ids=lambda v: str(v),
)
def test_hybrid_mixers_under_seqpar(world_size, part):
    run_ranks(world_size, _worker, part)


def test_mixer_implementations_read_what_transformers_dispatches_to(monkeypatch):
    """Note [mixer implementations]: a mixer's convolution reads as the package transformers' dispatcher found
    where that package runs on the tensors' device, as PyTorch ("torch") where it is missing or runs elsewhere,
    and as "unknown" where the module's function is no dispatcher; Mamba1's recurrence is seqpar's own. The
    dispatchers are built by transformers' own decorator, around a package that is installed (``json``)."""
    from transformers.integrations import hub_kernels

    from seqpar.sequence_parallel.mixers import implementations

    model = _model("mamba")
    module = sys.modules[type(anatomy(model).mixers[0]).__module__]
    own = module.causal_conv1d_fn

    def steps(device_type: str) -> list[tuple[str, str]]:
        return [(k.step, k.implementation) for k in implementations(anatomy(model).mixers, device_type)]

    assert steps("cpu") == [("convolution", "torch"), ("recurrence", "seqpar")]
    monkeypatch.setattr(
        module, "causal_conv1d_fn", hub_kernels.use_kernel_func_from_hub_with_fallback("dumps", "json")(own)
    )
    assert steps("cpu") == [("convolution", "json"), ("recurrence", "seqpar")]
    monkeypatch.setitem(hub_kernels._PACKAGE_SUPPORTED_DEVICES, "json", ("cuda",))
    monkeypatch.setattr(
        module, "causal_conv1d_fn", hub_kernels.use_kernel_func_from_hub_with_fallback("dumps", "json")(own)
    )
    assert steps("cuda")[0][1] == "json" and steps("cpu")[0][1] == "torch"
    assert "runs on cuda tensors, these are on cpu" in implementations(anatomy(model).mixers, "cpu")[0].why
    monkeypatch.setattr(module, "causal_conv1d_fn", lambda *a, **k: None)
    assert steps("cpu")[0][1] == "unknown"


def test_rg_lru_row_counts_the_block_and_the_estimate_refuses_recurrent_gemma():
    """Note [mixer rows]: the RG-LRU row counts the parameters of RecurrentGemma's recurrent block as built, and the
    exchange ``chunked_state_scan`` makes for it (two float32 numbers per channel and chunk); the memory estimate
    refuses the model by name rather than count its biased, half-width MLPs and biased ``o_proj`` as Llama's."""
    from seqpar.models.mixers import RgLru

    config = tiny_config("recurrent_gemma")
    model = _model("recurrent_gemma")
    row = RgLru.read(lambda name, default=None: getattr(config, name, default), RgLru.names, config.hidden_size)
    block = anatomy(model).mixers[0]
    assert row == RgLru(width=48, heads=4, conv_width=4)
    assert row.params(config.hidden_size) == sum(p.numel() for p in block.parameters())
    assert row.conv(config.hidden_size) == (48, 4) and row.exchange(rows=2, chunks=2) == 2 * 2 * 48 * 2 * 4
    with pytest.raises(SeqparInputError, match="model type 'recurrent_gemma': seqpar's sizes describe"):
        seqpar.estimate_memory(config, 1024, seqpar.ParallelDims(sp_size=2))
