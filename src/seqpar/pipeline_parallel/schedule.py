"""torch.distributed.pipelining stages and schedules for this rank's ``DecoderStage`` modules, shapes given up front.

Used by ``PipelineParallel``: one schedule per micro-batch shape, with static metadata (no shape-probing pass).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from seqpar.pipeline_parallel.stages import DecoderStage


def build_schedule(
    stages: list[DecoderStage],
    *,
    schedule: str,
    num_stages: int,
    microbatches: int,
    shape: tuple[int, int],
    sizes: tuple[int, int],
    dtype: torch.dtype,
    loss: Callable[..., torch.Tensor],
    last_returns_hidden: bool,
    group: dist.ProcessGroup,
    device: torch.device,
) -> object:
    """torch's schedule over ``stages`` for micro-batches of ``shape`` = (rows, tokens) per rank.

    Every stage is told its input and output shapes (``PipelineStage``'s static metadata): the first takes
    ``input_ids``, the others hidden states, and the last returns logits (or hidden states for a chunked
    loss). torch then allocates the receive buffers without running a probing forward and backward.

    Args:
        stages: this rank's stages, in order.
        schedule: "gpipe", "1f1b" or "interleaved".
        num_stages: stages in the whole pipeline.
        microbatches: micro-batches per step.
        shape: rows and tokens of one micro-batch on this rank.
        sizes: the hidden size and the vocabulary size.
        dtype: the dtype of the activations sent between stages.
        loss: ``loss(output, target, num_valid_tokens=...)`` on the last stage.
        last_returns_hidden: the last stage returns hidden states (the loss applies the head).
        group: the pipeline's ranks.
        device: where the stages compute.

    Returns:
        A ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` with ``scale_grads=False``
        (Note [pipeline loss]).
    """
    rows, seq = shape
    hidden_size, vocab = sizes
    hidden = torch.empty(rows, seq, hidden_size, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.empty(rows, seq, dtype=torch.int64, device="meta")
    logits = torch.empty(rows, seq, vocab, dtype=dtype, device="meta", requires_grad=True)
    last_out = hidden if last_returns_hidden else logits
    torch_stages = [
        PipelineStage(
            s,
            s.index,
            num_stages,
            device,
            input_args=(ids if s.first else hidden,),
            output_args=(last_out if s.last else hidden,),
            group=group,
        )
        for s in stages
    ]
    common = dict(n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(torch_stages, **common)
    return (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(torch_stages[0], **common)
