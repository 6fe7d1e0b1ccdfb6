"""Every valid layout of a model on a cluster, its memory and step time, ranked; and why the others are out.

``plan`` is the entry point; ``seqpar plan`` prints what it returns (``seqpar.planning.report``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from seqpar.errors import SeqparInputError
from seqpar.memory import MemoryEstimate
from seqpar.memory.dtypes import DTYPE_BYTES
from seqpar.mesh import ParallelDims
from seqpar.models import ModelSizes
from seqpar.planning.cluster import Cluster
from seqpar.planning.documents import check_doc_len
from seqpar.planning.memory import estimate_layout
from seqpar.planning.models import load_model_shape
from seqpar.planning.timing import FEATURES, OFFLOAD_OPTIMIZER, Layout, StepTime, model_flops, step_time
from seqpar.sequence_parallel.strategies.registry import strategy_options, strategy_row

DP_MODES = ("fsdp", "replicate")
# Offload moves the checkpointed hidden states: without checkpointing there are none. Optimizer offload is
# FSDP2's (``_try_features`` keeps it to fsdp families).
FEATURE_SETS = tuple(
    features
    for features in (
        tuple(itertools.compress(FEATURES, bits)) for bits in itertools.product((0, 1), repeat=len(FEATURES))
    )
    if "checkpointing" in features or "offload" not in features
)


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its predicted memory and speed."""

    layout: Layout
    """Degrees, strategy, features, dp mode."""
    memory: MemoryEstimate
    """Predicted memory of one rank, by category (``seqpar.estimate_memory``)."""
    time: StepTime
    """Predicted seconds of one step, by part."""
    tokens_per_s_per_gpu: float
    """Tokens trained per second, per device."""
    mfu: float
    """Model FLOPs (no recomputation) per second over the cluster's peak."""

    @property
    def peak_bytes(self) -> int:
        """Predicted peak memory of one rank."""
        return self.memory.peak


@dataclass(frozen=True)
class Rejection:
    """A family of layouts left out, and why."""

    family: str
    """What was left out, e.g. "tp 8 sp 4 ulysses 4 (ulysses)"."""
    reason: str
    """Why."""


@dataclass
class Plan:
    """The ranked layouts that fit, and the families that were rejected."""

    model: ModelSizes
    """The model's sizes."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per data-parallel replica per step."""
    dtype: str
    """Training dtype."""
    cluster: Cluster
    """The machines."""
    candidates: list[Candidate] = field(default_factory=list)
    """Every fitting layout, fastest (tokens/s per device) first."""
    rejected: list[Rejection] = field(default_factory=list)
    """Families left out, with reasons."""
    considered: int = 0
    """Layouts whose memory was estimated."""
    doc_len: int | None = None
    """Tokens per packed document, placed (Note [planned documents]); None: one document per sequence."""

    def top(self, n: int = 10) -> list[Candidate]:
        """The ``n`` best layouts, one per (degrees, strategy, dp mode): its fastest feature set that fits."""
        seen, best = set(), []
        for c in self.candidates:
            lay = c.layout
            key = (lay.pp, lay.dp, lay.sp, lay.ulysses, lay.tp, lay.strategy, lay.dp_mode)
            if key not in seen:
                seen.add(key)
                best.append(c)
            if len(best) == n:
                break
        return best


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_problem(model: ModelSizes, tp: int, cluster: Cluster) -> str | None:
    if tp > 1 and model.hybrid:  # Note [hybrid sizes]
        return f"a hybrid model's layers are planned at tp 1 (no tensor-parallel plan for its mixers), not {tp}"
    if tp > cluster.gpus_per_node and not cluster.ulysses_across_nodes:
        return f"tensor parallel of {tp} spans nodes of {cluster.gpus_per_node}"
    if model.num_attention_heads % tp or model.intermediate_size % tp:
        return f"{model.num_attention_heads} heads / {model.intermediate_size} MLP width do not divide by {tp}"
    if model.num_key_value_heads % tp:
        return f"{model.num_key_value_heads} KV heads do not divide by tp {tp}"
    return None


def _strategies(model: ModelSizes, sp: int, tp: int, cluster: Cluster):
    """(strategy, ulysses degree, problem or None) for every registry option at this sp x tp."""
    heads, kv = model.num_attention_heads // tp, max(1, model.num_key_value_heads // tp)
    for row, u in strategy_options(sp):
        problem = row.heads_problem(heads, kv, sp, u, f"{row.name} at tp {tp}")
        if problem is None and u > 1 and u * tp > cluster.gpus_per_node and not cluster.ulysses_across_nodes:
            problem = f"ulysses {u} x tp {tp} spans nodes of {cluster.gpus_per_node}"
        yield row.name, u, problem


def _family(layout: Layout) -> str:
    u = f" ulysses {layout.ulysses}" if strategy_row(layout.strategy).two_d else ""
    pp = f"pp {layout.pp} " if layout.pp > 1 else ""
    return f"{pp}dp {layout.dp} sp {layout.sp}{u} tp {layout.tp} {layout.strategy} {layout.dp_mode}"


def plan(
    model: str | dict | ModelSizes,
    seq_len: int,
    cluster: Cluster,
    *,
    micro_batch: int = 1,
    dtype: str = "bf16",
    dp_modes: tuple[str, ...] = DP_MODES,
    pp_microbatches: int = 8,
    doc_len: int | None = None,
) -> Plan:
    """Every valid (dp, sp, ulysses, tp, strategy, features, dp mode) for ``model`` on ``cluster``, ranked.

    Args:
        model: a preset name, a config.json or model dir, a config dict, or a ``ModelSizes``.
        seq_len: tokens per sequence.
        cluster: device count, memory, rates and links (``Cluster``, optionally ``with_calibration``).
        micro_batch: sequences per data-parallel replica per step.
        dtype: bf16, fp16 or fp32.
        dp_modes: how parameters are held over the dp x sp ranks: any of fsdp, replicate, ddp.
        pp_microbatches: micro-batches of ``micro_batch`` sequences per step of the pipeline-parallel layouts
            (1F1B); pp degrees above it are left out.
        doc_len: rows packed with documents of about this many tokens, sharded with the placed layout: the
            attention work and the K/V of ring and all-gather shrink (Note [planned documents]); None: one
            document per sequence.

    Returns:
        The plan: fitting layouts fastest first, rejected families with reasons.

    Raises:
        SeqparInputError: a non-positive length, batch or document length, an unknown dtype or dp mode, a bad
            model.
    """
    shape = load_model_shape(model)
    check_doc_len(doc_len)
    if not isinstance(seq_len, int) or seq_len < 1 or not isinstance(micro_batch, int) or micro_batch < 1:
        raise SeqparInputError(f"seq_len ({seq_len}) and micro_batch ({micro_batch}) must be positive integers")
    if dtype not in DTYPE_BYTES:
        raise SeqparInputError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if not dp_modes or any(m not in ("fsdp", "replicate", "ddp") for m in dp_modes):
        raise SeqparInputError(f"dp_modes must be some of fsdp, replicate, ddp, got {dp_modes}")
    result = Plan(shape, seq_len, micro_batch, dtype, cluster, doc_len=doc_len)
    for pp in _divisors(cluster.gpus):
        if pp > 1 and (pp > shape.num_hidden_layers or pp > pp_microbatches):
            why = (
                f"{shape.num_hidden_layers} layers"
                if pp > shape.num_hidden_layers
                else f"{pp_microbatches} micro-batches (--pp-microbatches)"
            )
            result.rejected.append(Rejection(f"pp {pp}", f"more pipeline stages than {why}"))
            continue
        _search_pp(result, pp, pp_microbatches if pp > 1 else 0, dp_modes)
    # ties to 6 digits (FSDP's hidden gathers make totals equal up to rounding) go to fewer features
    result.candidates.sort(
        key=lambda c: (-float(f"{c.tokens_per_s_per_gpu:.6g}"), len(c.layout.features), c.peak_bytes)
    )
    return result


def _search_pp(result: Plan, pp: int, microbatches: int, dp_modes: tuple[str, ...]) -> None:
    """Add the layouts with pipeline degree ``pp`` (and the families they reject) to ``result``."""
    shape, cluster, gpus = result.model, result.cluster, result.cluster.gpus // pp
    for tp in _divisors(gpus):
        problem = _tp_problem(shape, tp, cluster)
        if problem:
            result.rejected.append(Rejection(f"tp {tp}", problem))
            continue
        for sp in _divisors(gpus // tp):
            if result.seq_len % sp:
                why = f"seq_len {result.seq_len} does not divide by sp {sp}"
                result.rejected.append(Rejection(f"sp {sp} tp {tp}", why))
                continue
            for strategy, u, problem in _strategies(shape, sp, tp, cluster):
                for mode in dp_modes:
                    dims = ParallelDims.for_world(cluster.gpus, sp_size=sp, ulysses_size=u, tp_size=tp, pp_size=pp)
                    layout = Layout.of(dims, strategy, (), mode, microbatches)
                    if problem:
                        result.rejected.append(Rejection(_family(layout), problem))
                    else:
                        _try_features(result, layout)


def _try_features(result: Plan, family: Layout) -> None:
    """Add every feature set of ``family`` that fits to ``result``; if none does, record why."""
    budget, smallest = result.cluster.memory_bytes, None
    for features in FEATURE_SETS:
        if OFFLOAD_OPTIMIZER in features and family.dp_mode != "fsdp":
            continue
        layout = dataclasses.replace(family, features=features)
        estimate = estimate_layout(
            result.model, result.seq_len, layout, dtype=result.dtype, micro_batch=result.micro_batch
        )
        peak = estimate.peak
        result.considered += 1
        smallest = peak if smallest is None else min(smallest, peak)
        if peak > budget:
            continue
        time = step_time(
            result.model,
            result.seq_len,
            layout,
            result.cluster,
            dtype_bytes=DTYPE_BYTES[result.dtype],
            micro_batch=result.micro_batch,
            doc_len=result.doc_len,
        )
        sequences = result.micro_batch * layout.dp * (layout.pp_microbatches or 1)  # a pipeline step: m of them
        tokens = sequences * result.seq_len
        flops = model_flops(result.model, result.seq_len, sequences, result.doc_len)
        peak_rate = result.cluster.gpu_tflops * 1e12 * layout.world
        result.candidates.append(
            Candidate(layout, estimate, time, tokens / time.total / layout.world, flops / time.total / peak_rate)
        )
    if smallest is not None and smallest > budget:
        result.rejected.append(
            Rejection(
                _family(family),
                f"does not fit: {smallest / 2**30:.1f} GiB per rank at best (all feature sets) > "
                f"{budget / 2**30:.1f} GiB",
            )
        )
