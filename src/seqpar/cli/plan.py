"""``seqpar train --plan``: the planner's prediction for a training run's own settings, printed before any rank starts.

The model, length, degrees, strategy and memory features come from the ``TrainConfig``; nothing is trained.
"""

from __future__ import annotations

from seqpar.memory.dtypes import DTYPE_BYTES
from seqpar.memory.pipeline import bubble_fraction
from seqpar.models import ModelSizes
from seqpar.planning.cluster import Cluster
from seqpar.planning.report import format_plan
from seqpar.planning.search import plan
from seqpar.planning.timing import OFFLOAD_OPTIMIZER, Layout, step_time
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies.registry import LOCAL, strategy_row
from seqpar.train.config import TrainConfig
from seqpar.train.fit import memory_features, train_estimate
from seqpar.train.model import model_config
from seqpar.train.tokenizer import ByteTokenizer


def _layout(config: TrainConfig, heads: int, kv_heads: int) -> Layout:
    tp_heads, tp_kv = heads // config.tp, max(1, kv_heads // config.tp)
    if config.sp == 1:
        row = LOCAL  # one rank: "local", as seqpar.attention runs it
    else:
        row = strategy_row(select_strategy(config.strategy, tp_heads, tp_kv, config.sp, config.ulysses))
    strategy, ulysses = row.name, row.degree(config.sp, config.ulysses)
    features = (*memory_features(config), *((OFFLOAD_OPTIMIZER,) if config.offload_optimizer else ()))
    pieces = config.pp_microbatches or config.pp if config.pp > 1 else 0
    return Layout(config.dp, config.sp, ulysses, config.tp, strategy, features, config.dp_mode, config.pp, pieces)


def _pipeline(layout: Layout) -> str:
    """ "pp P (1f1b, M micro-batches, bubble B%) " for a pipeline layout, else ""."""
    if layout.pp == 1:
        return ""
    bubble = bubble_fraction(layout.pp, "1f1b", layout.pp_microbatches)
    return f"pp {layout.pp} (1f1b, {layout.pp_microbatches} micro-batches, bubble {bubble:.0%}) x "


def train_plan(config: TrainConfig) -> str:
    """The text ``seqpar train --plan`` prints for ``config``.

    Args:
        config: the resolved training settings.

    Returns:
        This layout's predicted memory by category and step time, then the ranked plan for its device count.

    Raises:
        SeqparInputError: a model config the planner or the estimator cannot read.
    """
    hf_config = model_config(config, ByteTokenizer.vocab_size)
    shape = ModelSizes.from_config(hf_config.to_dict(), source=config.model or "embedded default model")
    layout = _layout(config, shape.num_attention_heads, shape.num_key_value_heads)
    dtype = "bf16" if config.precision == "bf16" else "fp32"
    micro_batch = config.batch_size // config.grad_accum // (layout.pp_microbatches or 1)  # one pipeline piece
    cluster = Cluster(gpus=layout.world, gpus_per_node=min(layout.world, 8))
    estimate = train_estimate(config, hf_config)
    seq_len = estimate.tokens_per_rank * config.sp // micro_batch  # padded to a multiple of 2 x sp, as trained
    time = step_time(shape, seq_len, layout, cluster, dtype_bytes=DTYPE_BYTES[dtype], micro_batch=micro_batch)
    pieces = {"pp_microbatches": layout.pp_microbatches} if layout.pp > 1 else {}
    lines = [
        f"these settings: {_pipeline(layout)}dp {layout.dp} sp {layout.sp} ulysses {layout.ulysses} tp {layout.tp} "
        f"{layout.strategy} "
        f"{layout.dp_mode}, features {'+'.join(layout.features) or 'none'}, micro-batch {micro_batch}, {dtype}, "
        f"{seq_len} tokens per sequence" + (f" (padded from {config.seq_len})" if seq_len != config.seq_len else ""),
        estimate.table(),
        f"predicted step ({'one micro-batch in pipeline pieces' if pieces else 'one micro-batch'}) on H100-class "
        f"devices: {time.total:.3g} s "
        f"(matmul {time.matmul:.3g}, attention {time.attention:.3g}, all-to-all {time.all_to_all:.3g}, "
        f"tp {time.tensor_parallel:.3g}, gradients {time.gradients:.3g}, offload {time.offload:.3g}, "
        f"pipeline send/receive {time.pipeline:.3g}, bubble {time.bubble:.3g})",
        "",
        "ranked layouts for the same model, length and device count (`seqpar plan` describes other clusters):",
        format_plan(plan(shape, seq_len, cluster, micro_batch=micro_batch, dtype=dtype, **pieces)),
    ]
    return "\n".join(lines)
