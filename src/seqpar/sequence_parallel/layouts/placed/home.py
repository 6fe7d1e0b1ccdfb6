"""Filling every rank's home run with whole short documents, padding, and at most one cut document per gap.

The second half of Note [placed layout]; ``seqpar.sequence_parallel.layouts.placed.solver`` calls ``fill_homes``.
"""

from __future__ import annotations

GROUPED = 8
"""The most times the home runs of a row kept whole are searched for exchanges of two documents (``_groups``)."""
PAIRED = 8
"""The lightest documents of the top run and of each other run that ``_even`` tries in pairs, when no single
move or exchange evens the runs."""
BALANCE_SLACK = 1.05
"""The work, over a rank's mean, that a home assignment may reach and still count as even."""


def fill_homes(lengths: list[int], caps: list[int], home: list[int]) -> list[tuple[int, int, int]]:
    """Lay short documents into consecutive home runs (Note [placed layout]).

    Args:
        lengths: tokens of each short document.
        caps: tokens of each home run, in row order (they sum to the documents' tokens plus the padding).
        home: each document's home run from ``assign_homes`` (-1: cut into a gap).

    Returns:
        The home zone in row order as ``(document, first token, tokens)`` pieces; document -1 is padding.
    """
    left = {j for j, h in enumerate(home) if h < 0}  # documents no home run holds whole: cut into the gaps
    pieces: list[tuple[int, int, int]] = []
    carry: tuple[int, int] | None = None  # (document, tokens already placed)
    for h, cap in enumerate(caps):
        room, run = cap, []
        mine = [j for j, x in enumerate(home) if x == h]
        if carry is not None:  # the rest of the document cut at the end of the previous run
            j, done = carry
            take = min(lengths[j] - done, room)
            pieces.append((j, done, take))
            room -= take
            carry = (j, done + take) if done + take < lengths[j] else None
        for j in mine:  # this run's own documents, while they fit after the carried rest
            if lengths[j] <= room:
                run.append(j)
                room -= lengths[j]
            else:
                left.add(j)
        if carry is not None:
            continue
        for j in sorted(left, key=lambda j: (-lengths[j], j)):  # then whole documents that fit the gap
            if lengths[j] <= room:
                run.append(j)
                room -= lengths[j]
                left.discard(j)
        pieces += [(j, 0, lengths[j]) for j in sorted(run)]
        if room > 0 and not left:
            pieces.append((-1, 0, room))
        elif room > 0:  # cut one document: its head ends this run, its rest opens the next
            j = min(left, key=lambda j: (lengths[j], j))
            left.discard(j)
            pieces.append((j, 0, room))
            carry = (j, room)
    return pieces


def assign_homes(lengths: list[int], work: list[float], caps: list[int], loads: list[float], mean: float,
                 whole: bool = False) -> tuple[list[int], float]:  # fmt: skip
    """Each document's home run (-1: none has room) and the most loaded run's work over the mean.

    The best of three greedy rules, each evened by ``_even``.

    Longest first, each document goes to the run it fits in that is (a) least full in work and tokens
    together, (b) left with the most work room once its free tokens are counted at the mean work per token
    of the documents not yet placed (tokens and work run out together), or (c) left with the fewest free
    tokens (best fit: whole documents first). The rule whose most loaded run is within ``BALANCE_SLACK``
    of the mean and that leaves fewer documents without a home wins; else the one whose most loaded run is
    lighter. With ``whole`` (no refining pass follows), fewer documents without a home comes first, and the
    winner's runs are evened further by exchanging two documents for one or two (``_groups``).
    """
    best = None
    for rule in (_least_full, _most_room, _tightest):
        home, used, load = [-1] * len(lengths), [0] * len(caps), list(loads)
        left_work, left_tokens = sum(work), sum(lengths)
        for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], -work[j], j)):
            fits = [h for h in range(len(caps)) if used[h] + lengths[j] <= caps[h]]
            if fits:
                density = left_work / max(left_tokens, 1)
                h = min(fits, key=lambda h: (rule(h, j, lengths, work, caps, used, load, mean, density), h))
                home[j], used[h], load[h] = h, used[h] + lengths[j], load[h] + work[j]
            left_work, left_tokens = left_work - work[j], left_tokens - lengths[j]
        _even(home, lengths, work, caps, used, load, BALANCE_SLACK * mean, 0)
        top = max(load) / max(mean, 1e-300)
        key = (home.count(-1), top > BALANCE_SLACK, top) if whole else (top > BALANCE_SLACK, home.count(-1), top)
        if best is None or key < best[0]:
            best = (key, home, used, load)
    _, home, used, load = best
    if whole and max(load) > BALANCE_SLACK * mean:  # no refining pass follows: the costly exchanges too
        _even(home, lengths, work, caps, used, load, BALANCE_SLACK * mean, GROUPED)
    return home, max(load) / max(mean, 1e-300)


def _least_full(h: int, j: int, lengths: list[int], work: list[float], caps: list[int], used: list[int],
                load: list[float], mean: float, density: float) -> float:  # fmt: skip
    return load[h] / max(mean, 1e-300) + used[h] / max(caps[h], 1)


def _most_room(h: int, j: int, lengths: list[int], work: list[float], caps: list[int], used: list[int],
               load: list[float], mean: float, density: float) -> float:  # fmt: skip
    return load[h] + work[j] + density * (caps[h] - used[h] - lengths[j])


def _tightest(h: int, j: int, lengths: list[int], work: list[float], caps: list[int], used: list[int],
              load: list[float], mean: float, density: float) -> float:  # fmt: skip
    return caps[h] - used[h] - lengths[j]


def _even(home: list[int], lengths: list[int], work: list[float], caps: list[int], used: list[int],
          load: list[float], target: float, groups: int) -> None:  # fmt: skip
    """Move or exchange whole documents between the most loaded home run and another while that lowers the
    larger of their loads and both still hold their documents (in place; no document is cut); when no single
    move or exchange does and the top run is above ``target``, one or two of the top run's ``PAIRED`` lightest
    documents for none, one or two of another run's (``_groups``: the costly search, at most ``groups``
    times)."""
    grouped = 0
    for _ in range(4 * len(lengths)):
        top = max(range(len(caps)), key=lambda h: (load[h], -h))
        mine = [j for j, h in enumerate(home) if h == top]
        best = None
        for j, h in enumerate(home):  # a document of the top run exchanged with one of another run
            if h < 0 or h == top:
                continue
            for i in mine:
                if used[top] - lengths[i] + lengths[j] > caps[top] or used[h] - lengths[j] + lengths[i] > caps[h]:
                    continue
                after = max(load[top] - work[i] + work[j], load[h] + work[i] - work[j])
                if after < load[top] * (1 - 1e-9) and (best is None or after < best[0]):
                    best = (after, (i,), (j,), h)
        for i in mine:  # a document of the top run moved alone to a run with room
            for h in range(len(caps)):
                if h != top and used[h] + lengths[i] <= caps[h]:
                    after = max(load[top] - work[i], load[h] + work[i])
                    if after < load[top] * (1 - 1e-9) and (best is None or after < best[0]):
                        best = (after, (i,), (), h)
        if best is None and load[top] > target and grouped < groups:  # one or two for none, one or two
            few = sorted(mine, key=lambda j: (work[j], j))[:PAIRED]
            for h in range(len(caps)):
                if h == top:
                    continue
                theirs = sorted((j for j, x in enumerate(home) if x == h), key=lambda j: (work[j], j))[:PAIRED]
                for given, taken in _groups(few, theirs):
                    size = sum(lengths[x] for x in given) - sum(lengths[x] for x in taken)
                    if used[top] - size > caps[top] or used[h] + size > caps[h]:
                        continue
                    cost = sum(work[x] for x in given) - sum(work[x] for x in taken)
                    after = max(load[top] - cost, load[h] + cost)
                    if after < load[top] * (1 - 1e-9) and (best is None or after < best[0]):
                        best = (after, given, taken, h)
            grouped += 1
        if best is None:
            return
        _, given, taken, h = best
        for x, src, dst in [*((x, top, h) for x in given), *((x, h, top) for x in taken)]:
            home[x], used[src], used[dst] = dst, used[src] - lengths[x], used[dst] + lengths[x]
            load[src], load[dst] = load[src] - work[x], load[dst] + work[x]


def _groups(mine: list[int], theirs: list[int]):
    """Exchanges of one or two of ``mine`` for none, one or two of ``theirs`` that the single moves and
    exchanges of ``_even`` do not already try: two of mine for up to two, one of mine for two."""
    for a in range(len(mine)):
        for b in range(a + 1, len(mine)):
            yield (mine[a], mine[b]), ()
            for c in range(len(theirs)):
                yield (mine[a], mine[b]), (theirs[c],)
                for d in range(c + 1, len(theirs)):
                    yield (mine[a], mine[b]), (theirs[c], theirs[d])
        for c in range(len(theirs)):
            for d in range(c + 1, len(theirs)):
                yield (mine[a],), (theirs[c], theirs[d])
