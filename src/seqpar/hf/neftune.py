"""NEFTune under sequence parallelism: each rank adds its shard of the noise one process draws for the whole batch.

The Trainer mixin wraps every training forward in ``noisy_embeddings`` in place of transformers' NEFTune hook.

Note [NEFTune over shards]
    transformers' hook adds ``uniform(-m, m)`` noise of the embeddings' shape ``[B, S, H]`` to the input
    embeddings of every training forward, ``m = alpha / sqrt(S x H)``, drawn from the default generator of
    the embeddings' device. Under sequence parallelism a rank's embeddings are ``[B, S'/P, H]``. Every rank
    of the group draws the whole ``[B, S, H]`` noise, with the same magnitude and from the same generator
    state (every rank seeds it alike, and nothing else draws from it between), pads it as the rows were
    padded to the layout, and adds its own shard: the embeddings equal one process's. This needs the
    one process's batch to be this group's batch, so it is exact with one data-parallel replica only: with
    several, one process draws one tensor over the ``dp x B`` rows of every replica, whose width is that of
    the widest (or, packed, the whole concatenation), which no replica knows (``check_neftune`` refuses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import Layout, shard_sequence


def _noise_hook(alpha: float, width: int, mesh: SequenceParallelMesh, layout: Layout):
    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        rows, local, hidden = output.shape  # [B, S'/P, H], or [B, S, H] for a whole-row call
        # as transformers' neftune_post_forward_hook computes it, on a tensor of one process's shape
        magnitude = alpha / torch.sqrt(torch.tensor(width * hidden))
        noise = torch.zeros(rows, width, hidden, dtype=output.dtype, device=output.device)
        noise = noise.uniform_(-magnitude, magnitude)
        if local == width:  # a multimodal model embeds its whole rows (Note [whole-row calls])
            return output + noise
        noise = F.pad(noise, (0, 0, 0, local * mesh.sp_size - width))  # [B, S', H]: the layout's padding
        return output + shard_sequence(noise, mesh, dim=1, layout=layout)

    return hook


@contextlib.contextmanager
def noisy_embeddings(
    embeddings: torch.nn.Module, alpha: float | None, width: int | None, mesh: SequenceParallelMesh, layout: Layout
) -> Iterator[None]:
    """Within the block, ``embeddings`` adds this rank's shard of one process's NEFTune noise while training.

    Note [NEFTune over shards]. Call the model once inside the block; every rank of the sequence-parallel
    group must do so with its shard of the same batch.

    Args:
        embeddings: the model's input embeddings module.
        alpha: ``neftune_noise_alpha``; None (or 0): no noise, nothing is registered.
        width: the batch's sequence width before the layout's padding (``shard[WIDTH_KEYWORD]``); None: no noise.
        mesh: the sequence-parallel mesh.
        layout: the batch's layout (its ``ChunkLayout`` under "balanced").

    Yields:
        None.
    """
    if not alpha or width is None:
        yield
        return
    handle = embeddings.register_forward_hook(_noise_hook(alpha, width, mesh, layout))
    try:
        yield
    finally:
        handle.remove()
