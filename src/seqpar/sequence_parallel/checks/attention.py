"""The rules ``seqpar.attention``'s inputs must follow, checked on every rank at once (Note [agreeing on errors]).

Each rank's inputs become an ``InputSignature``; every rank checks every rank's row and raises the same error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.checks.agreement import Signature, by_rank, exchange_signatures
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS, PER_BATCH_LAYOUTS, ChunkLayout, chunks_per_rank
from seqpar.sequence_parallel.strategies.registry import STRATEGIES, STRATEGY_ROWS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

_KNOWN_DTYPES = (*DTYPES, torch.float64, torch.float8_e4m3fn, torch.int64, torch.int32, torch.bool)
_DEVICE_TYPES = ("cpu", "cuda", "meta")
_DOCUMENTS = ("none", "position_ids", "mask")


def _code(value: object, table: tuple) -> int:
    return table.index(value) if value in table else -1


@dataclass(frozen=True)
class TensorSignature(Signature):
    """One input tensor as integers: rank, first four sizes, dtype."""

    ndim: int
    dims: tuple[int, int, int, int]  # the first four sizes, zero-padded
    dtype_code: int  # index in _KNOWN_DTYPES, -1 for any other dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSignature:
        """The signature of ``t``."""
        dims = [*list(t.shape)[:4], *[0] * (4 - min(t.dim(), 4))]
        return cls(t.dim(), tuple(dims), _code(t.dtype, _KNOWN_DTYPES))

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes known (at most four)."""
        return self.dims[: min(self.ndim, 4)]

    @property
    def dtype(self) -> torch.dtype | str:
        """The dtype, or "an unsupported dtype" for one outside the known list."""
        return _KNOWN_DTYPES[self.dtype_code] if self.dtype_code >= 0 else "an unsupported dtype"


@dataclass(frozen=True)
class InputSignature(Signature):
    """What one rank passed to ``seqpar.attention``, as the ranks compare it."""

    strategy_code: int  # index in STRATEGIES, -1 for an unknown name
    layout_code: int  # index in LAYOUTS, len(LAYOUTS) for a ChunkLayout, -1 for an unknown name
    layout_chunks: int  # chunks per rank (0 for an unknown layout)
    layout_ranks: int  # ranks a ChunkLayout is for (0 for a named layout)
    layout_hash: int  # CRC-32 of a ChunkLayout's chunk ids (0 for a named layout): ranks must hold the same one
    causal: bool
    scale_ok: bool
    same_device: bool
    device_code: int  # index in _DEVICE_TYPES, -1 for another device type
    window: int  # -1: none, 0: invalid, else the window
    chunk: int  # chunked attention's chunk size, coded as window
    documents: int  # index in _DOCUMENTS: none, position ids, a prebuilt mask
    sink_heads: int  # -1: no sinks, -2: not a 1-D floating tensor on q's device, else their count
    softcap: int  # -1: none, 0: invalid, 1: a positive finite number
    alibi_heads: int  # ALiBi slopes, coded as sink_heads
    q: TensorSignature
    k: TensorSignature
    v: TensorSignature

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        strategy: str,
        layout: str | ChunkLayout,
        causal: bool,
        scale: float | None,
        window: int | None,
        documents: int,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        alibi: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> InputSignature:
        """The signature of one call's tensors and options (as ``check_attention_inputs`` takes them)."""
        scale_ok = scale is None or (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0)
        return cls(
            strategy_code=_code(strategy, STRATEGIES),
            **_layout_fields(layout),
            causal=bool(causal),
            scale_ok=bool(scale_ok),
            same_device=q.device == k.device == v.device,
            device_code=_code(q.device.type, _DEVICE_TYPES),
            window=_coded_size(window),
            chunk=_coded_size(chunk),
            documents=documents,
            sink_heads=_sink_heads(sinks, q),
            softcap=-1 if softcap is None else int(_positive_finite(softcap)),
            alibi_heads=_sink_heads(alibi, q),
            q=TensorSignature.of(q),
            k=TensorSignature.of(k),
            v=TensorSignature.of(v),
        )

    @property
    def strategy(self) -> str | None:
        """The strategy name, or None for an unknown one."""
        return STRATEGIES[self.strategy_code] if self.strategy_code >= 0 else None

    @property
    def layout(self) -> str | None:
        """The layout name ("chunks" for a ChunkLayout), or None for an unknown one."""
        if self.layout_code == len(LAYOUTS):
            return "chunks"
        return LAYOUTS[self.layout_code] if self.layout_code >= 0 else None


def _coded_size(size: int | None) -> int:
    """-1 for None, 0 for anything but a positive integer, else the size."""
    if size is None:
        return -1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _sink_heads(sinks: torch.Tensor | None, q: torch.Tensor) -> int:
    if sinks is None:
        return -1
    ok = isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.is_floating_point()
    return sinks.shape[0] if ok and sinks.device == q.device else -2


def _layout_fields(layout: object) -> dict[str, int]:
    if isinstance(layout, ChunkLayout):
        return dict(
            layout_code=len(LAYOUTS),
            layout_chunks=layout.chunks_per_rank,
            layout_ranks=layout.world_size,
            layout_hash=layout.digest,
        )
    code = _code(layout, LAYOUTS)
    chunks = chunks_per_rank(LAYOUTS[code]) if code >= 0 else 0
    return dict(layout_code=code, layout_chunks=chunks, layout_ranks=0, layout_hash=0)


SIGNATURE_LENGTH = InputSignature.width()  # int64 values each rank contributes to the check


def _problems(sig: InputSignature, sp_size: int, ulysses_size: int) -> list[str]:
    """Everything wrong with one rank's signature."""
    problems = []
    if sig.strategy is None:
        problems.append(f"unknown strategy; choose one of {STRATEGIES}")
    if sig.layout is None:
        problems.append(
            f"unknown layout; choose one of {LAYOUTS} or pass a ChunkLayout (layouts {', '.join(PER_BATCH_LAYOUTS)} "
            "are made per batch: pass shard.layout from seqpar.shard_batch)"
        )
    if sig.layout_ranks and sig.layout_ranks != sp_size:
        problems.append(f"the ChunkLayout is for {sig.layout_ranks} ranks but the group has {sp_size}")
    if not sig.scale_ok:
        problems.append("scale must be a positive finite number or None")
    if sig.window == 0:
        problems.append("window must be a positive integer (tokens a query sees, itself included) or None")
    if sig.chunk == 0:
        problems.append("chunk must be a positive integer (tokens of one attention chunk) or None")
    if sig.softcap == 0:
        problems.append("softcap must be a positive finite number or None")
    if sig.sink_heads == -2:
        problems.append("sinks must be a 1-D floating tensor [heads] on q's device")
    if sig.sink_heads >= 0 and sig.q.ndim == 4 and sig.sink_heads != sig.q.dims[1]:
        problems.append(f"sinks hold {sig.sink_heads} logits but q has {sig.q.dims[1]} heads (one per query head)")
    if sig.alibi_heads == -2:
        problems.append("alibi must be a 1-D floating tensor [heads] of slopes on q's device")
    if sig.alibi_heads >= 0 and sig.q.ndim == 4 and sig.alibi_heads != sig.q.dims[1]:
        problems.append(f"alibi holds {sig.alibi_heads} slopes but q has {sig.q.dims[1]} heads (one per query head)")
    if sig.window > 0 and not sig.causal:
        problems.append("a sliding window needs causal=True")
    if not sig.same_device:
        problems.append("q, k and v are on different devices; move them to one device")
    q, k, v = sig.q, sig.k, sig.v
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        problems.append(f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {q.ndim}-D, {k.ndim}-D, {v.ndim}-D")
        return problems
    for name, t in zip("qkv", (q, k, v)):
        if t.dtype not in DTYPES:
            problems.append(f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
    if not q.dtype == k.dtype == v.dtype:
        problems.append(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); use one dtype")
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[:3] != vs[:3]:
        problems.append(f"k {ks} and v {vs} must agree in batch, heads and local sequence")
    if not 0 < vs[3] <= MAX_HEAD_DIM:
        problems.append(f"v's head_dim {vs[3]} is outside 1..{MAX_HEAD_DIM}")
    if qs[0] != ks[0] or qs[2] != ks[2] or qs[3] != ks[3]:
        problems.append(f"q {qs} and k {ks} must agree in batch, local sequence and head_dim")
    if not 0 < qs[3] <= MAX_HEAD_DIM:
        problems.append(f"head_dim {qs[3]} is outside 1..{MAX_HEAD_DIM}")
    heads, kv_heads, local = qs[1], ks[1], qs[2]
    if kv_heads == 0 or heads % kv_heads:
        problems.append(f"key/value heads ({kv_heads}) must divide query heads ({heads})")
    if sig.layout is not None and local % sig.layout_chunks:
        problems.append(
            f"local sequence length {local} does not divide into the {sig.layout} layout: the global "
            f"sequence ({local} x {sp_size} ranks) must be a multiple of "
            f"{sig.layout_chunks * sp_size} (2P for zigzag); pad it"
        )
    if kv_heads and heads % kv_heads == 0:
        row = STRATEGY_ROWS.get(sig.strategy)  # "auto" picks a strategy the heads allow
        problem = row.heads_problem(heads, kv_heads, sp_size, ulysses_size) if row is not None else None
        problems += [problem] if problem is not None else []
    return problems


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    strategy: str,
    layout: str | ChunkLayout,
    causal: bool,
    scale: float | None,
    ulysses_size: int = 1,
    exchange: bool = True,
    window: int | None = None,
    documents: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi: torch.Tensor | None = None,
    chunk: int | None = None,
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
        sinks: the ``[heads]`` sink logits, or None.
        softcap: the logit soft-cap, or None.
        alibi: the ``[heads]`` ALiBi slopes, or None (ranks must agree: Note [ALiBi]).
        chunk: chunked attention's chunk size, or None.

    Raises:
        SeqparInputError: naming each problem and, when ranks differ, which rank had what.
    """
    size = 1 if group is None else dist.get_world_size(group)
    sig = InputSignature.of(q, k, v, strategy, layout, causal, scale, window, documents, sinks, softcap, alibi, chunk)
    if size == 1 or not exchange:
        problems = _problems(sig, size, ulysses_size)
    else:
        table = exchange_signatures(sig, group)
        problems = by_rank([_problems(row, size, ulysses_size) for row in table])
        if not problems and any(row != table[0] for row in table):
            described = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(table))
            problems.append(f"inputs differ across ranks (they must match): {described}")
    if problems:
        unknown = sig.strategy is None or sig.layout is None
        given = f" (this rank passed strategy={strategy!r}, layout={layout!r})" if unknown else ""
        raise SeqparInputError("seqpar.attention: " + " | ".join(problems) + given)


def _describe(sig: InputSignature) -> str:
    shapes = ", ".join(f"{n} {t.shape} {t.dtype}" for n, t in zip("qkv", (sig.q, sig.k, sig.v)))
    window = "none" if sig.window < 0 else sig.window
    chunk = "none" if sig.chunk < 0 else sig.chunk
    return (
        f"strategy={sig.strategy} layout={sig.layout} causal={sig.causal} window={window} chunk={chunk} "
        f"documents={_DOCUMENTS[sig.documents]} sinks={sig.sink_heads >= 0} softcap={sig.softcap >= 0} "
        f"alibi={sig.alibi_heads >= 0} {shapes}"
    )
