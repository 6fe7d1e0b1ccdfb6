"""The longest sequence a layout trains within a device's memory, by bisection over the memory estimate.

Used to compare the planner with published maximum lengths and by ``seqpar plan`` users asking "how long".
"""

from __future__ import annotations

from seqpar.errors import SeqparInputError
from seqpar.models import ModelSizes
from seqpar.planning.cluster import Cluster
from seqpar.planning.memory import estimate_layout
from seqpar.planning.models import load_model_shape
from seqpar.planning.timing import Layout


def max_seq_len(
    model: str | dict | ModelSizes,
    layout: Layout,
    cluster: Cluster,
    *,
    dtype: str = "bf16",
    micro_batch: int = 1,
    granularity: int = 1024,
) -> int:
    """The longest sequence, a multiple of ``granularity`` x sp tokens, whose predicted peak fits one device.

    Args:
        model: a preset name, a config.json or model dir, a config dict, or a ``ModelSizes``.
        layout: degrees, strategy, features and dp mode (its world size must equal ``cluster.gpus``).
        cluster: the device memory (``Cluster.memory_bytes``) is what matters here.
        dtype: bf16, fp16 or fp32.
        micro_batch: sequences per data-parallel replica.
        granularity: tokens per rank of the search step.

    Returns:
        The length in tokens; 0 when not even ``granularity`` tokens per rank fit.

    Raises:
        SeqparInputError: the layout's world size is not the cluster's, or a bad granularity.
    """
    shape = load_model_shape(model)
    if layout.world != cluster.gpus:
        raise SeqparInputError(f"layout covers {layout.world} ranks, the cluster has {cluster.gpus}")
    if granularity < 1:
        raise SeqparInputError(f"granularity must be positive, got {granularity}")
    step = granularity * layout.sp

    def fits(k: int) -> bool:
        peak = estimate_layout(shape, k * step, layout, dtype=dtype, micro_batch=micro_batch).peak
        return peak <= cluster.memory_bytes

    if not fits(1):
        return 0
    high = 2
    while fits(high):
        high *= 2
    low = high // 2
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * step
