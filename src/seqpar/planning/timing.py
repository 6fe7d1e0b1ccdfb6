"""How long one training step of a layout takes: FLOPs at a stated rate plus the collectives each link carries.

Note [plan time model] below states every assumption; ``step_time`` is the one entry point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from seqpar.errors import SeqparInputError
from seqpar.memory import FEATURES as MEMORY_FEATURES
from seqpar.memory.mixers import exchange_bytes
from seqpar.memory.pipeline import bubble_fraction, p2p_bytes, stage_views
from seqpar.mesh import ParallelDims
from seqpar.models import ModelSizes
from seqpar.planning.cluster import Cluster
from seqpar.planning.documents import check_doc_len, placed_kv_fraction, visible_fraction
from seqpar.sequence_parallel.strategies.registry import HeadSplit, head_split, strategy_row, ulysses_heads_problem

OFFLOAD_OPTIMIZER = "offload_optimizer"
"""The planner's name for FSDP2's CPU offload of parameters, gradients and optimizer state (fsdp layouts only)."""
FEATURES = (*MEMORY_FEATURES, OFFLOAD_OPTIMIZER)
"""What a layout may switch on: ``seqpar.memory.FEATURES`` (activations) and ``OFFLOAD_OPTIMIZER``."""

# Note [plan time model]
# One step is forward + backward of ``micro_batch`` sequences of ``seq_len`` tokens per data-parallel
# replica, then one gradient reduction; the optimizer update on the device (memory bound, a few ms) is
# left out, the one on the host under optimizer offload is not (last item).
# - Matmuls: 2 FLOPs per weight per token forward, twice that backward, each rank doing 1/sp of the
#   tokens and 1/tp of each layer's weights (the head is not split by tp). Checkpointing runs every
#   layer's forward again in backward; a tiled MLP recomputes its MLP once more; the chunked loss makes
#   its logits again in backward. All at ``Cluster.matmul_flops``.
# - Attention: causal, 2 S^2 H d FLOPs forward per sequence (half of the full 4 S^2 H d), 2.5x that in
#   backward (flash-style: five matmuls against two), shared evenly by the sp x tp ranks (zigzag
#   layout), plus one more forward under checkpointing; at ``Cluster.attention_flops``. An uneven head
#   split over the ulysses axis (Note [uneven heads]) makes the slowest rank attend ceil(H/U) heads, so the
#   attention time is the even share times ``HeadSplit.imbalance``.
# - Bytes on the wire are the analytical volumes ``python -m benchmarks.strategies`` checks against the kernel's
#   socket count (tests/test_bytes_sent.py): Ulysses sends (U-1)/U of q, k, v, out forward and dout, dq,
#   dk, dv backward (six of each, not four, when more than one KV head per rank stays after the
#   exchange; the busiest rank's ``HeadSplit.sent_heads`` under an uneven split); the ring sends K and V
#   P-1 hops forward and again backward and the float32 dK, dV P hops;
#   hybrid does both, the ring on the head-sharded tensors. Under checkpointing the forward exchanges
#   happen again. The all-gather strategy reduce-scatters dK, dV as NCCL does ((P-1)/P of the P-fold
#   tensor, half of what gloo's ring all-reduce sends).
# - Each collective runs over the slowest link its group crosses: ranks are ordered (dp, ring, ulysses,
#   tp) with tp innermost, so a group covering more consecutive ranks than a node crosses nodes.
# - Ring transfers overlap the attention blocks: a layer's attention costs max(compute, transfers) plus
#   one hop, which nothing can hide. All-to-alls, all-gathers and tensor-parallel all-reduces (two per
#   layer forward, two backward, of the [tokens, hidden] activation) are not overlapped.
# - Gradients are summed over the dp x sp ranks in the training dtype: replicate is one all-reduce after
#   backward (exposed); FSDP all-gathers the weights forward and backward and reduce-scatters gradients,
#   overlapped with compute (only the excess over compute shows); DDP's all-reduce overlaps the backward.
# - Offloaded checkpoints move on a side stream and are taken as hidden behind compute.
# - Optimizer offload (fsdp only, Note [optimizer offload]): every step copies each rank's fp32 parameter
#   shard host-to-device twice (forward and backward gathers, 4 bytes per parameter) and its gradient shard
#   device-to-host once (in the training dtype), over ``Cluster.host_link_gbps`` each way; the copies
#   overlap compute like FSDP's gathers (only the excess shows). The AdamW update then runs on the host,
#   after the backward, exposed: the node's ranks share ``Cluster.host_adam_gparams_per_s``. Without
#   offload the (on-device, memory-bound) update is left out as before.
# - Pipeline parallel (pp > 1, 1F1B, Note [pipeline memory and time]): a step runs ``pp_microbatches``
#   micro-batches of ``micro_batch`` sequences; one micro-batch on the busiest stage (its layers, and the
#   head, as on the last stage) costs what the items above give for a model of that stage's layers; the
#   step is m of them plus the bubble, (p - 1) more (a fraction (p - 1) / (m + p - 1) of the step), plus
#   the point-to-point activations and gradients between stages (not overlapped) over the slowest link (pp
#   is the outermost axis), plus the stage's gradient reduction over dp x sp once.
# - Packed documents (``doc_len``, placed): Note [planned documents] scales the attention work and ring K/V.
# - Hybrids (Note [hybrid sizes]): attention FLOPs and exchanges are those of the attention layers; each
#   mixer layer adds its all-gathers of halos and state summaries and their reduce-scatters (Note [hybrid
#   memory], gloo's (P-1) pieces each; again under checkpointing), not overlapped, in ``gather``. The mixers'
#   projections are in the matmul FLOPs; their scans' own arithmetic is left out.


@dataclass(frozen=True)
class Layout:
    """One way to run the step: the degrees, the strategy and the memory features."""

    dp: int
    """Data-parallel degree."""
    sp: int
    """Sequence-parallel degree (ranks sharing one sequence)."""
    ulysses: int
    """All-to-all degree inside sp (sp itself for ulysses, 1 for ring and all-gather)."""
    tp: int
    """Tensor-parallel degree."""
    strategy: str
    """ulysses, ring, hybrid or allgather."""
    features: tuple[str, ...] = ()
    """Memory features on: a subset of FEATURES ("offload_optimizer" with dp_mode fsdp only)."""
    dp_mode: str = "replicate"
    """replicate, ddp or fsdp."""
    pp: int = 1
    """Pipeline-parallel degree (the outermost axis; 1F1B)."""
    pp_microbatches: int = 0
    """Micro-batches of a pipeline step (0: pp)."""

    @classmethod
    def of(
        cls,
        dims: ParallelDims,
        strategy: str,
        features: tuple[str, ...] = (),
        dp_mode: str = "replicate",
        pp_microbatches: int = 0,
    ) -> Layout:
        """The layout of ``dims`` (its dp replicas counted as one degree) with a strategy, features and dp mode."""
        return cls(
            dims.dp_size,
            dims.sp_size,
            dims.ulysses_size,
            dims.tp_size,
            strategy,
            features,
            dp_mode,
            dims.pp_size,
            pp_microbatches,
        )

    @property
    def dims(self) -> ParallelDims:
        """The degrees as one ``seqpar.ParallelDims`` (the dp replicas sharded under dp_mode fsdp)."""
        dp = {"dp_shard_size" if self.dp_mode == "fsdp" else "dp_replicate_size": self.dp}
        return ParallelDims(**dp, sp_size=self.sp, ulysses_size=self.ulysses, tp_size=self.tp, pp_size=self.pp)

    @property
    def world(self) -> int:
        """Ranks in all."""
        return self.dims.world_size


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part; ``total`` is what the step takes."""

    matmul: float
    """Projections, MLP and head."""
    attention: float
    """Attention blocks, with the ring transfers they do not hide."""
    all_to_all: float
    """Ulysses exchanges."""
    gather: float
    """All-gather strategy's collectives."""
    tensor_parallel: float
    """Tensor-parallel all-reduces."""
    gradients: float
    """Gradient reduction (and FSDP's weight gathers) not hidden behind compute."""
    offload: float = 0.0
    """Optimizer offload: host <-> device copies not hidden behind compute, and the update on the host."""
    pipeline: float = 0.0
    """Point-to-point activations and gradients between pipeline stages."""
    bubble: float = 0.0
    """Pipeline fill and drain: the busiest stage idles this long."""

    @property
    def total(self) -> float:
        """The step's seconds."""
        return (
            self.matmul
            + self.attention
            + self.all_to_all
            + self.gather
            + self.tensor_parallel
            + self.gradients
            + self.offload
            + self.pipeline
            + self.bubble
        )


def _attention_flops(model: ModelSizes, seq_len: int, micro_batch: int) -> float:
    """Causal attention FLOPs of one forward over whole sequences (all ranks together; a hybrid's attention
    layers only, Note [hybrid sizes])."""
    layers = model.attention_layers
    return 2.0 * micro_batch * seq_len**2 * model.num_attention_heads * model.dim * layers


def model_flops(model: ModelSizes, seq_len: int, micro_batch: int = 1, doc_len: int | None = None) -> float:
    """FLOPs of forward + backward of ``micro_batch`` sequences, no recomputation (the MFU numerator).

    Args:
        model: the sizes.
        seq_len: tokens per sequence.
        micro_batch: sequences.
        doc_len: tokens per packed document (only the pairs inside documents count), or None.

    Returns:
        3x the forward matmul FLOPs (6 per weight per token) plus 3.5x the causal attention forward.
    """
    tokens = micro_batch * seq_len
    matmul = 6.0 * tokens * (model.num_hidden_layers * model.layer_params + model.hidden_size * model.vocab_size)
    return matmul + 3.5 * _attention_flops(model, seq_len, micro_batch) * visible_fraction(seq_len, doc_len)


def _matmul_seconds(model: ModelSizes, tokens: float, layout: Layout, cluster: Cluster) -> float:
    h, inter = model.hidden_size, model.mlp_width
    layer_passes = 3 + ("checkpointing" in layout.features)
    mlp_extra = model.num_hidden_layers * 3 * h * inter / layout.tp if "tiled_mlp" in layout.features else 0
    layers = model.num_hidden_layers * model.layer_params / layout.tp * layer_passes + mlp_extra
    head = h * model.vocab_size * (3 + ("chunked_loss" in layout.features))
    return 2.0 * tokens * (layers + head) / cluster.matmul_flops


def _split(heads: int, kv_heads: int, degree: int) -> HeadSplit:
    """The head split of the layout's all-to-all over ``degree`` ranks (Note [uneven heads])."""
    split = head_split(heads, kv_heads, degree)
    if split is None:
        raise SeqparInputError(ulysses_heads_problem(heads, kv_heads, degree, "the layout's ulysses axis"))
    return split


def step_time(
    model: ModelSizes,
    seq_len: int,
    layout: Layout,
    cluster: Cluster,
    *,
    dtype_bytes: int = 2,
    micro_batch: int = 1,
    doc_len: int | None = None,
) -> StepTime:
    """Seconds of one step of ``layout`` on ``cluster`` (Note [plan time model]).

    Args:
        model: the sizes.
        seq_len: tokens per sequence (whole, before the split).
        layout: degrees, strategy, features.
        cluster: rates and links.
        dtype_bytes: bytes per element of activations and gradients (2 for bf16, 4 for fp32).
        micro_batch: sequences per data-parallel replica in the step.
        doc_len: tokens per packed document, placed (Note [planned documents]); None: one per sequence.

    Returns:
        The seconds by part.

    Raises:
        SeqparInputError: heads (per tp rank) fewer than the layout's ulysses degree; optimizer offload
            in a layout whose dp mode is not fsdp; a ``doc_len`` that is not a positive integer.
    """
    check_doc_len(doc_len)
    if OFFLOAD_OPTIMIZER in layout.features and layout.dp_mode != "fsdp":
        raise SeqparInputError(f"{OFFLOAD_OPTIMIZER} needs dp_mode fsdp, not {layout.dp_mode!r}")
    if layout.pp > 1:
        return _pipeline_time(model, seq_len, layout, cluster, dtype_bytes, micro_batch, doc_len)
    layers, ckpt = model.num_hidden_layers, "checkpointing" in layout.features
    row = strategy_row(layout.strategy)
    tokens = micro_batch * seq_len / layout.sp  # on this rank
    d, e, u, r = model.dim, dtype_bytes, layout.ulysses, layout.sp // layout.ulysses
    heads, kv = model.num_attention_heads // layout.tp, max(1, model.num_key_value_heads // layout.tp)
    split = _split(heads, kv, u)
    # K/V heads' worth of this rank's tokens a ring carries after the all-to-all (the busiest rank's)
    ring_heads = kv if u == 1 else u * max(split.ring_kv_heads(j) for j in range(u))

    def kv_bytes(elem: int = e) -> float:
        return ring_heads * tokens * d * elem

    attention_layers = model.attention_layers
    forward = _attention_flops(model, seq_len, micro_batch) / (layout.sp * layout.tp) / max(1, attention_layers)
    forward *= split.imbalance  # the slowest rank's heads (Note [uneven heads])
    forward *= visible_fraction(seq_len, doc_len)
    placed = placed_kv_fraction(seq_len, doc_len, r)  # K/V a ring or all-gather still moves
    attention = forward * (3.5 + ckpt) / cluster.attention_flops  # per layer
    a2a = gather = 0.0
    if u > 1:
        # head groups (more than one KV head per rank after the exchange) resend q, k, v, out; hybrid has none
        tensors = 6 if row.head_groups and split.even and split.wire_kv_heads > u else 4
        moved = (tensors + 2 * ckpt) * split.sent_heads() * tokens * d * e
        a2a = moved / cluster.link(u * layout.tp)
    if r > 1 and row.kv_exchange == "gather":
        moved = (2 + ckpt) * (r - 1) * 2 * kv_bytes() + (r - 1) * 2 * kv_bytes(4)
        gather = placed * moved / cluster.link(layout.sp * layout.tp)
    elif r > 1:
        link = cluster.link(layout.sp * layout.tp)
        ring = placed * ((r - 1) * (4 + 2 * ckpt) * kv_bytes() + r * 2 * kv_bytes(4)) / link
        attention = max(attention, ring) + placed * 2 * kv_bytes() / link
    tp = 0.0
    if layout.tp > 1:
        tp = (4 + 2 * ckpt) * 2 * (layout.tp - 1) / layout.tp * tokens * model.hidden_size * e
        tp /= cluster.link(layout.tp)
    matmul = _matmul_seconds(model, tokens, layout, cluster)
    compute = matmul + attention * attention_layers
    return StepTime(
        matmul=matmul,
        attention=attention * attention_layers,
        all_to_all=a2a * attention_layers,
        gather=gather * attention_layers + _mixer_seconds(model, layout, cluster, e, micro_batch),
        tensor_parallel=tp * layers,
        gradients=_gradient_seconds(model, layout, cluster, e, compute),
        offload=_offload_seconds(model, layout, cluster, e, compute),
    )


def _mixer_seconds(model: ModelSizes, layout: Layout, cluster: Cluster, e: int, rows: int) -> float:
    """Seconds of a hybrid's mixer exchanges: each mixer layer's all-gathers of halos and state summaries and
    their reduce-scatters, again when checkpointing recomputes the layer (Note [hybrid memory]; zigzag chunks)."""
    if layout.sp == 1 or not model.hybrid:
        return 0.0
    passes = 2 + ("checkpointing" in layout.features)
    moved = sum(n * sum(exchange_bytes(model, kind, rows, 2, e)) for kind, n in model.kind_counts.items())
    return passes * (layout.sp - 1) * moved / cluster.link(layout.sp * layout.tp)


def _offload_seconds(model: ModelSizes, layout: Layout, cluster: Cluster, e: int, compute: float) -> float:
    """Exposed seconds of optimizer offload: host <-> device copies beyond compute, and the host's AdamW."""
    if OFFLOAD_OPTIMIZER not in layout.features:
        return 0.0
    shard = model.num_params / layout.tp / (layout.dp * layout.sp)  # parameters this rank updates
    copies = shard * (2 * 4 + e) / cluster.host_bytes_per_s  # fp32 shard in twice, gradient out once
    node_ranks = min(cluster.gpus_per_node, layout.world)
    return max(0.0, copies - compute) + shard * node_ranks / cluster.host_adam_params_per_s


def _gradient_seconds(model: ModelSizes, layout: Layout, cluster: Cluster, e: int, compute: float) -> float:
    """Exposed seconds of the gradient reduction (and FSDP's weight gathers) over the dp x sp ranks."""
    n = layout.dp * layout.sp
    if n == 1:
        return 0.0
    weights = model.num_params / layout.tp * e
    link = cluster.link(layout.world)
    if layout.dp_mode == "fsdp":
        return max(0.0, 3 * (n - 1) / n * weights / link - compute)
    seconds = 2 * (n - 1) / n * weights / link
    if layout.dp_mode == "ddp":  # overlaps the backward, two thirds of the compute
        return max(0.0, seconds - 2 * compute / 3)
    return seconds


def _pipeline_time(
    model: ModelSizes, seq_len: int, layout: Layout, cluster: Cluster, e: int, micro_batch: int, doc_len: int | None
) -> StepTime:
    """Seconds of one 1F1B pipeline step (Note [plan time model], pipeline parallel)."""
    p, m = layout.pp, layout.pp_microbatches or layout.pp
    busiest = stage_views(model.num_hidden_layers, p, "1f1b", m)[0].layers
    stage = dataclasses.replace(model, num_hidden_layers=busiest)
    flat = dataclasses.replace(layout, pp=1)
    one = step_time(stage, seq_len, flat, cluster, dtype_bytes=e, micro_batch=micro_batch, doc_len=doc_len)
    per_micro_batch = one.total - one.gradients - one.offload
    sent = p2p_bytes(int(micro_batch * seq_len / layout.sp), model.hidden_size, e)  # each tp rank sends it whole
    fraction = bubble_fraction(p, "1f1b", m)
    return StepTime(
        matmul=one.matmul * m,
        attention=one.attention * m,
        all_to_all=one.all_to_all * m,
        gather=one.gather * m,
        tensor_parallel=one.tensor_parallel * m,
        gradients=one.gradients,
        offload=one.offload,
        pipeline=m * sent / cluster.link(layout.world),
        bubble=m * per_micro_batch * fraction / (1 - fraction),
    )
