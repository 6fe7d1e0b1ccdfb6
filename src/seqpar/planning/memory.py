"""Per-rank memory of a layout, as the planner asks it of seqpar's memory estimator.

The estimator (``seqpar.memory.estimate_memory``) does the accounting; this module translates a ``Layout``.
"""

from __future__ import annotations

from seqpar.memory import MemoryEstimate, estimate_memory
from seqpar.models import ModelSizes
from seqpar.planning.timing import OFFLOAD_OPTIMIZER, Layout
from seqpar.sequence_parallel.strategies.registry import LOCAL, RING, strategy_row


def estimate_layout(
    model: ModelSizes, seq_len: int, layout: Layout, *, dtype: str, micro_batch: int = 1
) -> MemoryEstimate:
    """Predicted memory of one rank for one training step of ``layout`` (AdamW).

    "offload_optimizer" in ``layout.features`` is the estimator's ``offload_optimizer``; the rest are its
    features.

    Args:
        model: the sizes.
        seq_len: tokens per sequence.
        layout: degrees, strategy, features, dp mode.
        dtype: bf16, fp16 or fp32.
        micro_batch: sequences per data-parallel replica.

    Returns:
        The estimator's bytes by category and peak.

    Raises:
        SeqparInputError: the estimator refuses the layout (e.g. a length sp does not divide, optimizer offload
            without fsdp).
    """
    return estimate_memory(
        model.as_config(),
        seq_len,
        layout.dims,
        dtype=dtype,
        micro_batch=micro_batch,
        features=tuple(f for f in layout.features if f != OFFLOAD_OPTIMIZER),
        strategy=RING.name if strategy_row(layout.strategy) is LOCAL else layout.strategy,  # one rank: no exchange
        dp_mode=layout.dp_mode,
        offload_optimizer=OFFLOAD_OPTIMIZER in layout.features,
        pp_microbatches=layout.pp_microbatches or None,
    )
