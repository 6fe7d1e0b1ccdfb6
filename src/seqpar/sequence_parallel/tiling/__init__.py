"""The tiling and cost engine: which (query, key) blocks a rank computes, how they are tiled, what they cost.

Strategies run its plans; layouts and the strategy choice read its costs.
"""

from seqpar.sequence_parallel.tiling.planner import plan_cost

__all__ = ["plan_cost"]
