"""The chain candidate of Note [placed layout]: one contiguous run per rank, dense documents across run ends.

``layouts.placed.solver`` builds it beside the long-zone candidates and keeps whichever refines best.
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.layouts.placed.home import BALANCE_SLACK, assign_homes, fill_homes
from seqpar.sequence_parallel.layouts.placed.split import WORK_SLACK, fill_costs

TAIL_SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
"""The work a dense document's tail may bring to its run, over a rank's mean, tried for all of them at once
(Note [placed layout]); the best is then moved by ``SHARE_STEP`` either way for each document on its own. A
larger tail leaves a shorter head to send, a smaller one more room to even the runs."""
SHARE_STEP = 0.05
"""How far one document's tail share moves either way from the shared one, while that lowers the traffic."""
REFINE_ROOM = 1.1
"""The most work a chain run may hold over the mean and still be handed to the refining pass to even."""


def dense_documents(lengths: list[int], work: list[float], share: int, padding: int, mean: float) -> list[int]:
    """Documents that no run can hold whole: longer than a run, or with the rest of the run filled as cheaply
    as the others allow (padding first, then whole documents by work per token), more work than
    ``WORK_SLACK`` of the mean.

    Args:
        lengths: tokens of every document.
        work: attention work of every document.
        share: tokens of a run.
        padding: padding tokens of the row.
        mean: a rank's mean work.

    Returns:
        Their indices, the one with the most work first (found one at a time: a dense document leaves the
        cheap fill to the others).
    """
    dense: list[int] = []
    while True:
        rest = [d for d in range(len(lengths)) if d not in dense]
        cheap = fill_costs([lengths[d] for d in rest], [work[d] for d in rest], padding)
        top = cheap.shape[0] - 1
        over = [d for d in rest if lengths[d] > share
                or work[d] + float(cheap[min(share - lengths[d], top)]) > WORK_SLACK * mean]  # fmt: skip
        if not over:
            return dense
        dense.append(max(over, key=lambda d: (work[d], -d)))


def chain_segments(
    docs: list[tuple[int, int]], work: list[float], total: torch.Tensor, p: int, share: int
) -> list[tuple[int, int, int]] | None:
    """The chain layout's row as segments, or None where it does not apply or no share keeps its runs within
    ``REFINE_ROOM`` of the mean.

    Run ``r`` (rank ``r``) holds ``share`` tokens: the tail of the dense document crossing its start, whole
    documents, padding, and the head of the dense document crossing its end. Dense documents cross
    alternate run ends (0-1, 2-3, ...), so that a run sends one head or receives one tail, not both; a row
    with more dense documents than that is left to the long-zone candidates.
    Each document's tail is the longest whose work fits a share of the mean (``TAIL_SHARES``); the other
    documents are given runs by ``assign_homes``. The largest share (the shortest heads) whose runs stay
    within ``BALANCE_SLACK`` is kept, else the share with the most even runs within ``REFINE_ROOM`` (the
    refining pass evens the rest); then each document's share is moved by ``SHARE_STEP`` while that lowers
    the busiest run's traffic (a head ``h`` costs its run ``2h``, the next run ``h``). None when no share
    comes within ``REFINE_ROOM``: the refining pass would cut many documents to even the runs, which the
    long-zone candidates do with fewer cuts.

    Args:
        docs: (start, length) of every document of the row.
        work: attention work of every document.
        total: ``[S + 1]`` cumulative attention work of the row's tokens.
        p: ranks.
        share: tokens per run.

    Returns:
        ``(first source token or -1 for padding, tokens, position id of the first)`` segments in row order.
    """
    lengths = [n for _, n in docs]
    padding = p * share - sum(lengths)
    if p < 2 or padding < 0 or max(lengths) > 2 * share:
        return None
    mean = sum(work) / p
    dense = dense_documents(lengths, work, share, padding, mean)
    ends = list(range(0, p - 1, 2))  # alternate run ends: no run both receives a tail and sends a head
    if not dense or len(dense) > len(ends):
        return None
    ends = ends[: len(dense)]
    short = [d for d in range(len(docs)) if d not in dense]

    def score(shares: tuple[float, ...]) -> tuple | None:
        """(key, segments) of one tail share per dense document, or None where the runs cannot hold it."""
        cuts, tokens, load = {}, [0] * p, [0.0] * p
        for d, end, tail_share in zip(dense, ends, shares):
            start, n = docs[d]
            tail_work = total[start + n] - total[start + 1 : start + n + 1].flip(0)  # work of the last 1..n tokens
            h = n - max(1, int((tail_work <= tail_share * mean).sum()))
            if h <= 0:  # its tail alone holds it: not this share
                return None
            cuts[end] = (d, h)
            head_work = float(total[start + h] - total[start])
            tokens[end], load[end] = tokens[end] + h, load[end] + head_work
            tokens[end + 1], load[end + 1] = tokens[end + 1] + n - h, load[end + 1] + work[d] - head_work
        if max(tokens) > share or max(load) > REFINE_ROOM * mean:
            return None
        caps = [share - x for x in tokens]
        home, _ = assign_homes([lengths[d] for d in short], [work[d] for d in short], caps, load, mean)
        segments = _lay_runs(docs, short, home, caps, cuts, p)
        if segments is None:
            return None
        sent, loads = _runs_of(segments, total, share, p)
        top = max(loads) / mean
        return (
            None if top > REFINE_ROOM else ((top > BALANCE_SLACK, max(sent) if top <= BALANCE_SLACK else top), segments)
        )

    best = None
    for tail_share in TAIL_SHARES:  # one share for all: the largest that evens the runs, else the most even
        got = score((tail_share,) * len(dense))
        if got is not None and (best is None or got[0] < best[0][0]):
            best = (got, (tail_share,) * len(dense))
        if best is not None and not best[0][0][0]:
            break
    for i in range(len(dense) if best is not None else 0):
        for step in (SHARE_STEP, -SHARE_STEP):
            shares = (*best[1][:i], best[1][i] + step, *best[1][i + 1 :])
            got = score(shares)
            if got is not None and got[0] < best[0][0]:
                best = (got, shares)
    return None if best is None else best[0][1]


def _lay_runs(docs, short: list[int], home: list[int], caps: list[int], cuts: dict, p: int) -> list | None:
    """The row's segments: per stretch of runs between two dense crossings, the dense tail, the stretch's
    documents laid by ``fill_homes`` (a document no run holds whole is cut at a run end inside the stretch),
    the dense head; None when a stretch cannot hold its documents."""
    stretches = [[]]
    for r in range(p):
        stretches[-1].append(r)
        if r in cuts and r < p - 1:
            stretches.append([])
    room = [sum(caps[r] for r in runs) - sum(docs[short[j]][1] for j, h in enumerate(home) if h in runs)
            for runs in stretches]  # fmt: skip
    where = {r: i for i, runs in enumerate(stretches) for r in runs}
    assigned = [where[h] if h >= 0 else -1 for h in home]
    for j in sorted((j for j, h in enumerate(home) if h < 0), key=lambda j: (-docs[short[j]][1], j)):
        i = max(range(len(stretches)), key=lambda i: (room[i], -i))  # the stretch with the most room
        if room[i] < docs[short[j]][1]:
            return None
        assigned[j], room[i] = i, room[i] - docs[short[j]][1]
    segments = []
    for i, runs in enumerate(stretches):
        if runs[0] - 1 in cuts:
            d, h = cuts[runs[0] - 1]
            segments.append((docs[d][0] + h, docs[d][1] - h, h))
        mine = [j for j in range(len(home)) if assigned[j] == i]
        local = {r: x for x, r in enumerate(runs)}
        pieces = fill_homes([docs[short[j]][1] for j in mine], [caps[r] for r in runs],
                            [local.get(home[j], -1) for j in mine])  # fmt: skip
        if sum(n for _, _, n in pieces) != sum(caps[r] for r in runs):
            return None
        segments += [(docs[short[mine[j]]][0] + offset if j >= 0 else -1, n, offset) for j, offset, n in pieces]
        if runs[-1] in cuts:
            d, h = cuts[runs[-1]]
            segments.append((docs[d][0], h, 0))
    return segments


def _runs_of(
    segments: list[tuple[int, int, int]], total: torch.Tensor, share: int, p: int
) -> tuple[list[int], list[float]]:
    """Tokens of K/V each run moves, and its attention work. For every document over several runs, a run
    receives the earlier pieces once (their gradients go back) and sends its own piece to every later run
    twice (forward and backward)."""
    pieces: dict[int, list[int]] = {}  # document start -> tokens per run
    load, at = [0.0] * p, 0
    for first, n, offset in segments:
        if first >= 0:
            doc = pieces.setdefault(first - offset, [0] * p)
            for r in range(at // share, (at + n - 1) // share + 1):
                lo, hi = max(at, r * share) - at + first, min(at + n, (r + 1) * share) - at + first
                doc[r] += hi - lo
                load[r] += float(total[hi] - total[lo])
        at += n
    sent = [0] * p
    for per_run in pieces.values():
        before = 0
        for r, n in enumerate(per_run):
            if n:
                sent[r] += before + 2 * n * sum(1 for later in per_run[r + 1 :] if later)
                before += n
    return sent, load
