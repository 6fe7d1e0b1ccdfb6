"""Filling every rank's home run with whole short documents, padding, and at most one cut document per gap.

The second half of Note [placed layout]; ``seqpar.placement.solver`` calls ``fill_homes``.
"""

from __future__ import annotations

__all__ = ["fill_homes"]


def fill_homes(
    lengths: list[int], work: list[float], caps: list[int], loads: list[float], mean: float, pad_budget: int
) -> list[tuple[int, int, int]]:
    """Lay short documents into consecutive home runs (Note [placed layout]).

    Args:
        lengths: tokens of each short document.
        work: attention work of each short document.
        caps: tokens of each home run, in row order (they sum to the documents' tokens plus ``pad_budget``).
        loads: the work each home run's rank already holds (its long-document chunks).
        mean: a rank's mean work.
        pad_budget: padding tokens to place in all.

    Returns:
        The home zone in row order as ``(document, first token, tokens)`` pieces; document -1 is padding.
    """
    home = _assign(lengths, work, caps, loads, mean)
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


def _assign(lengths: list[int], work: list[float], caps: list[int], loads: list[float], mean: float) -> list[int]:
    """Each document's home run (-1: none has room): longest first, to the run least full in work and tokens."""
    home, used, load = [-1] * len(lengths), [0] * len(caps), list(loads)
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        fits = [h for h in range(len(caps)) if used[h] + lengths[j] <= caps[h]]
        if fits:
            h = min(fits, key=lambda h: (load[h] / max(mean, 1e-300) + used[h] / max(caps[h], 1), h))
            home[j], used[h], load[h] = h, used[h] + lengths[j], load[h] + work[j]
    return home
