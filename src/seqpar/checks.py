"""Input checks for ``seqpar.attention`` that fail the same way on every rank, before any collective can hang.

Note [agreeing on errors]
    A check that fails on one rank only (one rank has a different length, dtype or strategy) must not leave
    the other ranks waiting inside a collective. Each rank therefore encodes what it was given as a short
    integer signature, the group all-gathers the signatures (one small collective), and every rank runs
    the same checks over the same table. All ranks reach the same verdict and raise the same message.
    With ``check_inputs=False`` the exchange is skipped and only this rank's own inputs are checked.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from seqpar.comm.collectives import all_gather_first_dim, collective_device
from seqpar.errors import SeqparInputError
from seqpar.layout import LAYOUTS, chunks_per_rank

__all__ = ["DTYPES", "STRATEGIES", "by_rank", "check_attention_inputs", "exchange_signatures", "ulysses_degrees"]

STRATEGIES = ("ulysses", "ring", "allgather", "hybrid", "auto")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

_KNOWN_DTYPES = (*DTYPES, torch.float64, torch.float8_e4m3fn, torch.int64, torch.int32, torch.bool)
_DEVICE_TYPES = ("cpu", "cuda", "meta")
# signature: strategy, layout, causal, scale_ok, same_device, device, window (-1: none), documents
# (0: none, 1: position_ids, 2: a prebuilt mask),
# then per tensor (ndim, 4 dims, dtype)
_HEADER = 8
_PER_TENSOR = 6
SIGNATURE_LENGTH = _HEADER + 3 * _PER_TENSOR  # int64 values each rank contributes to the check


def _code(value: object, table: tuple) -> int:
    return table.index(value) if value in table else -1


def _signature(
    q, k, v, strategy: str, layout: str, causal: bool, scale: float | None, window: int | None, documents: int
) -> list[int]:
    scale_ok = scale is None or (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0)
    sig = [
        _code(strategy, STRATEGIES),
        _code(layout, LAYOUTS),
        int(bool(causal)),
        int(scale_ok),
        int(q.device == k.device == v.device),
        _code(q.device.type, _DEVICE_TYPES),
        -1 if window is None else (window if isinstance(window, int) and window > 0 else 0),
        documents,
    ]
    for t in (q, k, v):
        dims = [*list(t.shape)[:4], *[0] * (4 - min(t.dim(), 4))]
        sig += [t.dim(), *dims, _code(t.dtype, _KNOWN_DTYPES)]
    return sig


def _decode(sig: list[int]) -> dict:
    tensors = {}
    for i, name in enumerate("qkv"):
        base = _HEADER + i * _PER_TENSOR
        ndim = sig[base]
        dtype_code = sig[base + 5]
        tensors[name] = (
            ndim,
            tuple(sig[base + 1 : base + 1 + min(ndim, 4)]),
            _KNOWN_DTYPES[dtype_code] if dtype_code >= 0 else "an unsupported dtype",
        )
    return {
        "strategy": STRATEGIES[sig[0]] if sig[0] >= 0 else None,
        "layout": LAYOUTS[sig[1]] if sig[1] >= 0 else None,
        "scale_ok": bool(sig[3]),
        "same_device": bool(sig[4]),
        "window": sig[6],
        "tensors": tensors,
    }


def _problems(sig: list[int], sp_size: int, ulysses_size: int) -> list[str]:
    """Everything wrong with one rank's signature."""
    d = _decode(sig)
    problems = []
    if d["strategy"] is None:
        problems.append(f"unknown strategy; choose one of {STRATEGIES}")
    if d["layout"] is None:
        problems.append(f"unknown layout; choose one of {LAYOUTS}")
    if not d["scale_ok"]:
        problems.append("scale must be a positive finite number or None")
    if d["window"] == 0:
        problems.append("window must be a positive integer (tokens a query sees, itself included) or None")
    if d["window"] > 0 and not sig[2]:
        problems.append("a sliding window needs causal=True")
    if not d["same_device"]:
        problems.append("q, k and v are on different devices; move them to one device")
    (qn, qs, qd), (kn, ks, kd), (vn, vs, vd) = (d["tensors"][n] for n in "qkv")
    if qn != 4 or kn != 4 or vn != 4:
        problems.append(f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {qn}-D, {kn}-D, {vn}-D")
        return problems
    for name, dtype in zip("qkv", (qd, kd, vd)):
        if dtype not in DTYPES:
            problems.append(f"{name} has dtype {dtype}; supported: float32, bfloat16, float16")
    if not qd == kd == vd:
        problems.append(f"q, k, v dtypes differ ({qd}, {kd}, {vd}); use one dtype")
    if ks != vs:
        problems.append(f"k {ks} and v {vs} shapes differ")
    if qs[0] != ks[0] or qs[2] != ks[2] or qs[3] != ks[3]:
        problems.append(f"q {qs} and k {ks} must agree in batch, local sequence and head_dim")
    if not 0 < qs[3] <= MAX_HEAD_DIM:
        problems.append(f"head_dim {qs[3]} is outside 1..{MAX_HEAD_DIM}")
    heads, kv_heads, local = qs[1], ks[1], qs[2]
    if kv_heads == 0 or heads % kv_heads:
        problems.append(f"key/value heads ({kv_heads}) must divide query heads ({heads})")
    if d["layout"] is not None and local % chunks_per_rank(d["layout"]):
        problems.append(
            f"local sequence length {local} does not divide into the {d['layout']} layout: the global "
            f"sequence ({local} x {sp_size} ranks) must be a multiple of "
            f"{chunks_per_rank(d['layout']) * sp_size} (2P for zigzag); pad it"
        )
    if kv_heads and heads % kv_heads == 0:
        if d["strategy"] == "ulysses" and sp_size > 1:
            problems += _ulysses_problems(heads, kv_heads, sp_size, "ulysses")
        if d["strategy"] == "hybrid" and ulysses_size > 1:
            problems += _ulysses_problems(heads, kv_heads, ulysses_size, "hybrid's ulysses axis")
    return problems


def ulysses_degrees(heads: int, kv_heads: int) -> list[int]:
    """The Ulysses degrees these heads allow (query heads divisible; KV heads divisible or dividing)."""
    return [p for p in range(1, heads + 1) if heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)]


def _ulysses_problems(heads: int, kv_heads: int, size: int, what: str) -> list[str]:
    valid = ulysses_degrees(heads, kv_heads)
    instead = "(or use strategy 'ring', 'allgather', or 'hybrid' with a smaller ulysses_size)"
    if heads % size:
        return [f"{what} needs query heads ({heads}) divisible by the degree {size}; valid degrees: {valid} {instead}"]
    if kv_heads % size and size % kv_heads:
        return [
            f"{what} needs key/value heads ({kv_heads}) divisible by the degree {size} or dividing it; "
            f"valid degrees: {valid} {instead}"
        ]
    return []


def by_rank(per_rank: list[list[str]]) -> list[str]:
    """Each distinct problem once, prefixed with the ranks that have it ("every rank" or "rank 0, 2")."""
    problems = []
    for message in dict.fromkeys(m for rank_problems in per_rank for m in rank_problems):
        ranks = [r for r, rank_problems in enumerate(per_rank) if message in rank_problems]
        where = "every rank" if len(ranks) == len(per_rank) else f"rank {', '.join(map(str, ranks))}"
        problems.append(f"{where}: {message}")
    return problems


def exchange_signatures(sig: list[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's integer signature, in rank order (one small all-gather; Note [agreeing on errors])."""
    mine = torch.tensor(sig, dtype=torch.int64, device=collective_device(group))
    return all_gather_first_dim(mine[None], group).tolist()


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    strategy: str,
    layout: str,
    causal: bool,
    scale: float | None,
    ulysses_size: int = 1,
    exchange: bool = True,
    window: int | None = None,
    documents: int = 0,
) -> None:
    """Raise the same ``SeqparInputError`` on every rank if any rank's inputs are bad (Note [agreeing on errors]).

    Args:
        q, k, v: this rank's inputs.
        group: the sequence-parallel group (None: one process).
        strategy, layout, causal, scale: the call's options.
        ulysses_size: the mesh's Ulysses degree (checked against the heads for "hybrid").
        window: the sliding window, or None.
        documents: 0 without packed documents, 1 with position ids, 2 with a prebuilt mask (ranks must agree,
            since position ids cost every rank an all-gather).
        exchange: all-gather the signatures so that every rank sees every rank's inputs.

    Raises:
        SeqparInputError: naming each problem and, when ranks differ, which rank had what.
    """
    size = 1 if group is None else dist.get_world_size(group)
    sig = _signature(q, k, v, strategy, layout, causal, scale, window, documents)
    if size == 1 or not exchange:
        problems = _problems(sig, size, ulysses_size)
    else:
        table = exchange_signatures(sig, group)
        problems = by_rank([_problems(row, size, ulysses_size) for row in table])
        if not problems and any(row != table[0] for row in table):
            described = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(table))
            problems.append(f"inputs differ across ranks (they must match): {described}")
    if problems:
        given = f" (this rank passed strategy={strategy!r}, layout={layout!r})" if min(sig[:2]) < 0 else ""
        raise SeqparInputError("seqpar.attention: " + " | ".join(problems) + given)


def _describe(sig: list[int]) -> str:
    d = _decode(sig)
    shapes = ", ".join(f"{n} {s} {dt}" for n, (_, s, dt) in d["tensors"].items())
    window = "none" if d["window"] < 0 else d["window"]
    documents = ("none", "position_ids", "mask")[sig[7]]
    return (
        f"strategy={d['strategy']} layout={d['layout']} causal={bool(sig[2])} window={window} "
        f"documents={documents} {shapes}"
    )
