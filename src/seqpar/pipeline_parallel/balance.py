"""Where a pipeline cuts a model: contiguous runs of decoder layers with the largest stage as small as possible.

Sizes are parameter counts; the first stage also holds the input embedding, the last the final norm and head.
"""

from __future__ import annotations

from torch import nn

from seqpar.pipeline_parallel.stages import ModelParts


def _count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balanced_split(layer_sizes: list[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layers per stage: contiguous runs of at least one layer whose largest stage is as small as possible.

    Args:
        layer_sizes: parameters of each layer, in order.
        stages: number of stages (at most ``len(layer_sizes)``).
        first_extra: parameters that the first stage holds besides its layers (the input embedding).
        last_extra: parameters that the last stage holds besides its layers (final norm and head).

    Returns:
        ``stages`` positive counts summing to ``len(layer_sizes)`` (ties broken the same way on every rank).

    Raises:
        ValueError: fewer layers than stages (callers check first and raise ``SeqparInputError``).
    """
    n = len(layer_sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold layers 0..i-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for end in range(s, n - (stages - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], cost(s - 1, start, end))
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    counts, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


def part_sizes(parts: ModelParts) -> tuple[list[int], int, int]:
    """The sizes ``balanced_split`` weighs.

    Args:
        parts: from ``find_parts``.

    Returns:
        Parameters of each layer, of the embedding (first stage) and of the final norm and head (last stage;
        the head counted there even when tied, as the last stage then holds a copy).
    """
    return [_count(layer) for layer in parts.layers], _count(parts.embedding), _count(parts.norm) + _count(parts.head)
