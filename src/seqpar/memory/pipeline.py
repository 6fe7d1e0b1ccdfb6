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
      last rank: GPipe m; 1F1B 1; interleaved min(m v, (v - 1) p + 1) / v.
    Logits on the last rank: torch's last stage computes a micro-batch's loss in its forward and keeps the
    stage's output until that micro-batch's backward has run, so each of the last stage's micro-batches in
    flight (n: GPipe m, 1F1B 1, interleaved 1: its last stage's forward and backward of a micro-batch run back
    to back) holds its logits [T, V] in the model's dtype and the loss's float32 log-softmax; at the start of
    one micro-batch's backward that one adds the loss's gradients (Note [memory estimate]), and while its
    layers run backward the n logits and the n - 1 other log-softmaxes are still held. Measured with
    ``python -m benchmarks.pipeline`` (4 x 256 Llama, vocabulary 4096, seq 1024, m 4): the last rank under GPipe held
    108 MiB above its layers' activations where 112 MiB of logits were due (a model with one logits
    micro-batch predicted 0), 1F1B 14 MiB where 16 were due. With the chunked loss the last stage returns
    hidden states and no micro-batch's whole logits exist; that case is not measured.
    The estimate takes the larger peak of the first rank (most activations, no logits) and the last rank
    (the head, the logits). Bubble (idle fraction of the step): (p - 1) / (m + p - 1) for GPipe and 1F1B,
    (p - 1) / (v m + p - 1) for interleaved (the fill and drain run in chunks of 1 / v of a stage).
    Receive buffers: torch's ``PipelineStage`` allocates, once, one receive buffer per micro-batch for each
    activation a stage receives and for each gradient it receives for its output, and keeps them from step
    to step: a first or last rank's v stages have v boundaries on one side and v - 1 on the other, m (2 v - 1)
    buffers of [micro_batch, S / sp, H] in the model's dtype (a middle rank of pp > 2 keeps 2 v m; middle
    ranks are not estimated). They belong to ``between_steps``. Counted from the stage objects by ``seqpar
    bench pipeline`` at m 8: 8 MiB on each rank under 1F1B and 24 MiB under interleaved, as predicted; for a
    70B model at 128K tokens, sp 2 and m 8 they are 8 GiB per rank. A non-first stage's first layer takes
    its input in such a buffer, which the activations in flight count once more (one [T, H] of a stage's
    layers' many).
    Sends held: torch's runtime for several stages per rank (ScheduleInterleaved1F1B) waits for its sends only
    when the step ends, so every activation and gradient a rank sent stays alive until then: m (2 v - 1)
    [micro_batch, S / sp, H] tensors by the end. The estimate adds them whole to the activations of both
    activation moments, an upper bound: the peak comes in the steady state, when most but not all have been
    sent; GPipe and 1F1B wait for their sends as they go, so nothing of the kind is counted for them (the
    interleaved measurement: docs/benchmarks.md, "Longest sequence in a memory budget").
    Point-to-point traffic: each stage boundary carries one activation [micro_batch, S / sp, H] in the
    model's dtype forward and its gradient backward per micro-batch; a rank sends (and receives) v of them
    each way per micro-batch (one at the pipeline's ends), 2 v m T H b bytes per pipeline step.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError

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
    logits_in_flight: int = 1
    """Micro-batches of the last stage whose logits are held at once (on the last rank)."""
    recv_buffers: int = 0
    """Receive buffers of one micro-batch's activation or gradient that torch's stages on this rank keep."""
    sends_held: int = 0
    """Sent activations and gradients of one micro-batch each that the schedule holds until the step ends."""


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
    logits = m if schedule == "gpipe" else 1
    buffers = m * (2 * v - 1)  # per micro-batch: v boundaries one way, v - 1 the other (an end has none)
    sends = buffers if schedule == "interleaved" else 0  # as many sends as receives, held to the step's end
    return [
        StageView(busiest, first, False, 1, buffers, sends),
        StageView(busiest, last, True, logits, buffers, sends),
    ]


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


def held_logits_bytes(view: StageView, tokens: int, vocab: int, dtype_bytes: int) -> int:
    """Logits a pipeline's last rank holds while a micro-batch's layers run backward (whole-logits loss).

    Args:
        view: the rank (``stage_views``); 0 unless it is the last.
        tokens: tokens of one micro-batch on this rank.
        vocab: the vocabulary size.
        dtype_bytes: bytes per element of the logits (the model's dtype).

    Returns:
        n x tokens x vocab x dtype_bytes for the n micro-batches' logits in flight, plus the float32
        log-softmax of the n - 1 whose backward has not started (Note [pipeline memory and time]).
    """
    if not view.last:
        return 0
    n = view.logits_in_flight
    return n * tokens * vocab * dtype_bytes + (n - 1) * tokens * vocab * 4
