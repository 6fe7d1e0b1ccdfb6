"""Packed rows the benchmarks share: the global position ids of seeded document mixes (uneven, SFT-like, RL-like).

Used by ``benchmarks.masks`` (one row per kind) and ``benchmarks.placement`` (many seeded rows per kind).
"""

from __future__ import annotations

import math

import torch

__all__ = ["log_normal_documents", "rl_groups", "short_documents", "uneven_documents"]


def uneven_documents(seq: int, docs: int) -> torch.Tensor:
    """Position ids of ``docs`` documents of uneven lengths filling ``seq`` tokens (cut points seeded by ``docs``).

    Args:
        seq: tokens in the row.
        docs: documents in the row (also the seed of their random cut points).

    Returns:
        ``[seq]`` position ids restarting at 0 at every document.
    """
    cuts = torch.randperm(seq - 1, generator=torch.Generator().manual_seed(docs))[: docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), seq]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])


def log_normal_documents(seq: int, seed: int, median: int = 2000, sigma: float = 1.5) -> torch.Tensor:
    """``[S]`` position ids of documents with log-normal lengths (clipped to 100..64K tokens) filling ``seq``.

    Args:
        seq: tokens in the row (the last document is cut to fit).
        seed: the generator seed.
        median: median document length.
        sigma: standard deviation of the log length.

    Returns:
        Position ids restarting at 0 at every document.
    """
    gen = torch.Generator().manual_seed(seed)
    pieces, used = [], 0
    while used < seq:
        n = int(min(65536, max(100, math.exp(math.log(median) + sigma * torch.randn(1, generator=gen).item()))))
        n = min(n, seq - used)
        pieces.append(torch.arange(n))
        used += n
    return torch.cat(pieces)


def rl_groups(seq: int, seed: int, group: int = 8) -> torch.Tensor:
    """Position ids of an RL-like row: groups of ``group`` completions of one prompt, each prompt + completion.

    Prompts are 100-600 tokens; a group's completions share a log-normal length (median S/32) within 20%.

    Args:
        seq: tokens in the row (the last sequence is cut to fit).
        seed: the generator seed.
        group: completions per prompt.

    Returns:
        ``[seq]`` position ids restarting at 0 at every prompt + completion.
    """
    gen = torch.Generator().manual_seed(seed)
    pieces, used = [], 0
    while used < seq:
        prompt = int(torch.randint(100, 600, (1,), generator=gen))
        typical = math.exp(math.log(seq / 32) + 0.5 * torch.randn(1, generator=gen).item())
        for _ in range(group):
            n = min(int(prompt + typical * (0.8 + 0.4 * torch.rand(1, generator=gen).item())), seq - used)
            if n > 0:
                pieces.append(torch.arange(n))
                used += n
    return torch.cat(pieces)


def short_documents(seq: int, ranks: int, seed: int) -> torch.Tensor:
    """Position ids of log-normal documents (median S/32) all shorter than S/(2P): longer ones are cut in pieces.

    Args:
        seq: tokens in the row.
        ranks: the sequence-parallel degree P.
        seed: the generator seed.

    Returns:
        ``[seq]`` position ids restarting at 0 at every document.
    """
    ids = log_normal_documents(seq, seed, max(100, seq // 32))
    starts = [*(ids == 0).nonzero().flatten().tolist(), seq]
    cap = seq // (2 * ranks) - 1
    lengths = [n for a, b in zip(starts, starts[1:]) for n in [cap] * ((b - a) // cap) + [(b - a) % cap] if n]
    return torch.cat([torch.arange(n) for n in lengths])
