"""Pipeline parallel in the memory estimate and the planner's time model: the busiest rank's layers, the
micro-batches it holds in flight, the bubble, and the point-to-point traffic between stages.

Note [pipeline memory and time]
    p = pp_size, m = micro-batches per pipeline step, v = stages per rank (2 for "interleaved", else 1),
    L decoder layers; one micro-batch of ``micro_batch`` rows has T = micro_batch x S / sp tokens per rank.
    Layers: the balanced split (Note [pipeline stages]) cuts L into p v stages; the busiest rank runs v
    stages of ceil(L / (p v)) layers. Parameters: those layers plus one end of the model, the input
    embedding on the first rank or the final norm and output head on the last (a tied head's copy too).
    Activations in flight, in micro-batches of this rank's layers (each stage's activations of one
    micro-batch live from its forward to its backward):
      first rank, GPipe: every forward runs before any backward: m.
      first rank, 1F1B: p - 1 warm-up forwards, then one forward per backward: min(m, p).
      first rank, interleaved (torch's ScheduleInterleaved1F1B): (v - 1) p + 2 (p - 1) warm-up chunk
        forwards of L / (p v) layers before its first backward, one more in the steady state:
        min(m v, (v - 1) p + 2 p - 1) / v, that is p (1 + (p - 1) / (p v)) micro-batches for m >= p.
      last rank: GPipe m; 1F1B 1; interleaved min(m v, (v - 1) p + 1) / v. The logits and loss of one
        micro-batch exist there only.
    The estimate takes the larger peak of the first rank (most activations, no logits) and the last rank
    (the head, the logits). Bubble (idle fraction of the step): (p - 1) / (m + p - 1) for GPipe and 1F1B,
    (p - 1) / (v m + p - 1) for interleaved (the fill and drain run in chunks of 1 / v of a stage).
    Point-to-point traffic: each stage boundary carries one activation [micro_batch, S / sp, H] in the
    model's dtype forward and its gradient backward per micro-batch; a rank sends (and receives) v of them
    each way per micro-batch (one at the pipeline's ends), 2 v m T H b bytes per pipeline step.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError

__all__ = ["PP_SCHEDULES", "StageView", "bubble_fraction", "check_pipeline", "p2p_bytes", "stage_views"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class StageView:
    """One pipeline rank as the memory estimate sees it (Note [pipeline memory and time])."""

    layers: int
    """Decoder layers this rank runs (over all its stages)."""
    in_flight: float
    """Micro-batches of this rank's layers whose activations are held at once."""
    last: bool
    """This rank computes the logits and the loss (and holds the output head)."""


def _per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def check_pipeline(layers: int, pp_size: int, schedule: str, microbatches: int | None) -> list[str]:
    """Problems with pipeline settings for a model of ``layers`` decoder layers (empty when they work).

    Args:
        layers: decoder layers of the model.
        pp_size: pipeline-parallel degree.
        schedule: "gpipe", "1f1b" or "interleaved".
        microbatches: micro-batches per pipeline step (None: pp_size).

    Returns:
        One line per problem.
    """
    if pp_size < 1:
        return [f"pp_size must be a positive integer, not {pp_size!r}"]
    if schedule not in PP_SCHEDULES:
        return [f"unknown pp_schedule {schedule!r}; choose from {', '.join(PP_SCHEDULES)}"]
    m = microbatches or pp_size
    problems = []
    if pp_size > 1 and m < pp_size:
        problems.append(f"pp_microbatches {m} is fewer than pp_size {pp_size}")
    if pp_size * _per_rank(schedule) > layers:
        problems.append(f"{pp_size * _per_rank(schedule)} pipeline stages need at least as many layers, not {layers}")
    return problems


def stage_views(layers: int, pp_size: int, schedule: str, microbatches: int | None) -> list[StageView]:
    """The first and the last pipeline rank (one view when pp_size is 1).

    Args:
        layers: decoder layers of the model.
        pp_size: pipeline-parallel degree.
        schedule: "gpipe", "1f1b" or "interleaved".
        microbatches: micro-batches per pipeline step (None: pp_size).

    Returns:
        ``StageView``s: the first rank's, then the last rank's.

    Raises:
        SeqparInputError: settings ``check_pipeline`` refuses.
    """
    problems = check_pipeline(layers, pp_size, schedule, microbatches)
    if problems:
        raise SeqparInputError("cannot estimate the pipeline:\n  - " + "\n  - ".join(problems))
    if pp_size == 1:
        return [StageView(layers, 1.0, True)]
    p, m, v = pp_size, microbatches or pp_size, _per_rank(schedule)
    busiest = v * -(-layers // (p * v))
    if schedule == "gpipe":
        first, last = float(m), float(m)
    elif schedule == "1f1b":
        first, last = float(min(m, p)), 1.0
    else:
        first, last = min(m * v, (v - 1) * p + 2 * p - 1) / v, min(m * v, (v - 1) * p + 1) / v
    return [StageView(busiest, first, False), StageView(busiest, last, True)]


def bubble_fraction(pp_size: int, schedule: str, microbatches: int | None) -> float:
    """The fraction of a pipeline step a rank idles (Note [pipeline memory and time]).

    Args:
        pp_size: pipeline-parallel degree.
        schedule: "gpipe", "1f1b" or "interleaved".
        microbatches: micro-batches per pipeline step (None: pp_size).

    Returns:
        (p - 1) / (m + p - 1), or (p - 1) / (2 m + p - 1) for interleaved (two stages per rank); 0 at pp 1.
    """
    p, m = pp_size, microbatches or pp_size
    return (p - 1) / (_per_rank(schedule) * m + p - 1)


def p2p_bytes(tokens: int, hidden: int, dtype_bytes: int, schedule: str = "1f1b") -> int:
    """Bytes one rank sends per micro-batch between pipeline stages, forward and backward together.

    Args:
        tokens: tokens of one micro-batch on this rank (rows x S / sp).
        hidden: the model's hidden size.
        dtype_bytes: bytes per element of the activations.
        schedule: "interleaved" sends at each of its two stages.

    Returns:
        2 v x tokens x hidden x dtype_bytes (one activation forward, its gradient backward, per stage).
    """
    return 2 * _per_rank(schedule) * tokens * hidden * dtype_bytes
