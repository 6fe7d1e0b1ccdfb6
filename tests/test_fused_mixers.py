"""The hybrid mixers on fla's and mamba_ssm's fused kernels, which Triton's interpreter runs on CPU (Note [interpreted
kernels]): every recurrence call seqpar makes goes to the fused kernel, and seqpar equals one process on it.

At P = 2, zigzag, a packed row (tests/test_mixers.py's documents), on the tiny Qwen3-Next (gated DeltaNet), Kimi
Linear (KDA) and GraniteMoeHybrid (SSD): the kernels' autograd Functions see exactly the calls Note [state passing]
describes (fla's: one ``cu_seqlens`` call per kind of piece and layer), the opening calls (values dv + dk wide for
the delta rule) among them, forward and backward, and transformers' PyTorch kernels none; logits, loss and every
parameter's gradient equal one process on the same kernels within ``FLOOR_FACTOR`` times one fp32 process's
distance from float64 on transformers' PyTorch kernels (fla runs no float64). Slow (interpreted kernels take
seconds a call): the ``fused`` tier, after scripts/setup_fused.sh.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections import Counter
from datetime import timedelta

import pytest
import torch

import seqpar
from seqpar.models import anatomy
from seqpar.runtime.spawn import spawn_ranks
from tests import _interpreter
from tests._dist import shard_index
from tests.test_mixers import DOCUMENTS, FLOOR_FACTOR, SEQ, _everyones, _float64, _gradients, _ids, _model, _one_process

pytestmark = [
    pytest.mark.fused,
    pytest.mark.skipif(
        bool(_interpreter.missing()),
        reason=f"the fused tier needs {', '.join(_interpreter.missing())}: scripts/setup_fused.sh makes .venv-fused",
    ),
]

KERNELS = {
    # kind: (the kernel's autograd Function, the position of its values, the modeling module's dispatcher, whether
    # seqpar calls it once per kind of piece with cu_seqlens: VARLEN_PACKAGES)
    "qwen3_next": (
        "fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction", 2, "torch_chunk_gated_delta_rule", True
    ),
    "kimi_linear": ("fla.ops.kda.chunk.ChunkKDAFunction", 2, "chunk_kimi_delta_attention", True),
    "granitemoehybrid": (
        "mamba_ssm.ops.triton.ssd_combined.MambaChunkScanCombinedFn", 0, "mamba2_chunk_scan", False
    ),
}  # fmt: skip
ULP = 2.0**-24  # fp32's unit roundoff: a floor is at least 2 ulps of its tensor's largest entry


def _widths(mixer: torch.nn.Module) -> tuple[int, int]:
    """The values' width of a piece run from zero and of an opening piece (Note [state passing]): dv and dv + dk for
    the delta rule, the head's width for SSD (its opening runs from zero too)."""
    if hasattr(mixer, "head_v_dim"):  # gated DeltaNet
        return mixer.head_v_dim, mixer.head_v_dim + mixer.head_k_dim
    if hasattr(mixer, "forget_gate"):  # KDA: dk = dv
        return mixer.head_dim, 2 * mixer.head_dim
    return mixer.head_dim, mixer.head_dim


def _expected_calls(rank: int, world_size: int, widths: tuple[int, int], varlen: bool) -> Counter:
    """One layer's kernel calls on ``rank``'s zigzag shard of the packed row, as (tokens, values' width): each chunk
    cut where a document starts, and its pieces that run alike (from zero, or opening a chunk that continues a
    document) with the same length stacked into one call; ``varlen``: whatever their lengths, end to end."""
    starts = set(itertools.accumulate(DOCUMENTS, initial=0))
    index = shard_index("zigzag", world_size, rank, SEQ).tolist()
    size = len(index) // 2
    groups = Counter()
    for chunk in (index[:size], index[size:]):
        cuts = [i for i, t in enumerate(chunk) if t in starts and i > 0]
        for a, z in zip([0, *cuts], [*cuts, size], strict=True):
            opens = chunk[a] not in starts and chunk[a] > 0
            groups[opens, 0 if varlen else z - a] += z - a  # tokens of the pieces that share one call
    return Counter((total if varlen else length, widths[opens]) for (opens, length), total in groups.items())


def _references(rank: int, kind: str, module: object, name: str, counted) -> dict:
    """Rank 0: one process on the fused kernels; rank 1: one process on transformers' PyTorch kernels, in fp32 and
    float64 (the floor). Logits, loss, every gradient."""
    ids = _ids(1, 3)
    if rank == 0:
        model = _model(kind)
        logits, loss = _one_process(model, ids, packed=True)
        return {"fused": (logits, loss, _gradients(model))}
    torch_kernel, runs = _interpreter.torch_function(getattr(module, name)), {}
    dispatcher = getattr(module, name)
    with counted() as calls:
        setattr(module, name, torch_kernel)  # the module's calls take transformers' PyTorch kernel
        try:
            for dtype in ("fp32", "fp64"):
                model = _model(kind) if dtype == "fp32" else _float64(_model(kind))
                logits, loss = _one_process(model, ids, packed=True)
                runs[dtype] = (logits, loss, _gradients(model))
        finally:
            setattr(module, name, dispatcher)
    assert not calls.forward, f"{kind}: the floor's runs called the fused kernel {len(calls.forward)} times"
    return runs


def _judge(what: str, found: torch.Tensor, fused: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> float:
    """``found`` (seqpar) within ``FLOOR_FACTOR`` times the floor of ``fused`` (one process on the fused kernels), and
    ``fused`` as near float64 on transformers' PyTorch kernels: the floor is one fp32 process's distance from float64
    on those kernels, at least 2 ulps of the tensor's largest entry. Returns the least margin (bound over gap)."""
    floor = max(float((fp32.double() - fp64).abs().max()), 2 * ULP * float(fp64.abs().max()))
    margin = math.inf
    for gap, whose in (((found.double() - fused.double()), "one fused process"), ((fused.double() - fp64), "float64")):
        gap = float(gap.abs().max())
        assert gap <= FLOOR_FACTOR * floor, f"{what}: {gap:.2e} from {whose}, past {FLOOR_FACTOR:g} x {floor:.2e}"
        margin = min(margin, FLOOR_FACTOR * floor / gap if gap else math.inf)
    return margin


def _fused(rank: int, world_size: int, kind: str) -> None:
    _interpreter.install()
    path, values, name, varlen = KERNELS[kind]
    function = getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1])
    model = _model(kind)
    mixers = anatomy(model).mixers
    module = sys.modules[type(mixers[0]).__module__]

    def counted():
        return _interpreter.counted(function, values, getattr(module, name))

    refs = _everyones(_references(rank, kind, module, name, counted), world_size)
    mesh = seqpar.make_mesh()
    model = seqpar.prepare_model(model, mesh, strategy="ring")
    batch = {"input_ids": _ids(1, 3), "position_ids": torch.cat([torch.arange(n) for n in DOCUMENTS])[None]}
    shard = seqpar.shard_batch(batch, mesh, layout="zigzag")
    with counted() as calls:
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], seqpar_layout=shard.layout)
        loss = seqpar.cross_entropy(out.logits, shard["shift_labels"], mesh)
        loss.backward()
    seqpar.reduce_gradients(model.parameters(), mesh)
    want = Counter(
        {call: n * len(mixers) for call, n in _expected_calls(rank, world_size, _widths(mixers[0]), varlen).items()}
    )
    assert Counter(calls.forward) == want, f"{kind} rank {rank}: kernel calls {Counter(calls.forward)}, not {want}"
    assert calls.package == len(calls.forward) == calls.backward, (kind, rank, calls)
    assert calls.fallback == 0, f"{kind} rank {rank}: transformers' PyTorch kernel ran {calls.fallback} times"
    idx = shard_index("zigzag", world_size, rank, SEQ)
    (logits, loss_one, grads), runs = refs["fused"], [refs["fp32"], refs["fp64"]]
    what = f"{kind} P={world_size} zigzag packed, rank {rank}"
    margins = {"logits": _judge(f"{what} logits", out.logits.detach(), logits[:, idx], *(r[0][:, idx] for r in runs))}
    total = seqpar.sum_over(loss.detach(), mesh)
    margins["loss"] = _judge(f"{what} loss", total, loss_one, *(r[1] for r in runs))
    for i, (n, p) in enumerate(model.named_parameters()):
        found = p.grad if p.grad is not None else torch.zeros_like(p)
        margins[n] = _judge(f"{what} {n}", found, grads[i], *(r[2][i] for r in runs))
    least = min(margins, key=margins.get)
    print(f"{what}: fused calls {dict(Counter(calls.forward))}; least margin {margins[least]:.2f} ({least})")


@pytest.mark.parametrize("kind", list(KERNELS))
def test_mixers_run_seqpar_calls_on_the_fused_kernels_exactly(kind):
    # fresh ranks, as the interpreter's shims stay in a process; a peer waits out the other's interpreted reference
    spawn_ranks(_fused, 2, kind, timeout=timedelta(minutes=10))
