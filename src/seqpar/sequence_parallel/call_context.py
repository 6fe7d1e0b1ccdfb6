"""What a prepared model's forward hook hands its layers: the mesh, the batch's layout and mask, the strategy.

It travels in the layers' keyword arguments, which transformers passes down to attention and to the mixers.

Note [context in the mask]
    Some families' layers do not hand their keywords down to the mixers: Mamba's and Falcon-Mamba's model with a
    head calls its decoder, and that decoder its blocks, with ``attention_mask`` and no other keywords, and
    Jamba's Mamba layers call the mixer with its mask alone. The one argument that reaches those mixers from
    the model call, unchanged, is the mask (a mask mapping by layer type, which Jamba's decoder takes as it
    is), so for such a family (``Family.mask_context``) the prepared model's hook puts the ``CallContext``
    there, where seqpar's calls carry no mask of their own; the mixers' adapters and the decoder's hook read it
    back. RWKV's blocks take no keywords and no mask at all: the one argument its decoder hands every block, and
    each block its two mixers, is the recurrent ``state`` (its cache), so there the context travels as the
    ``state`` (a call that brings a state of its own is refused, as a cache). It is part of the layer's call, so
    activation checkpointing, which replays the layer's ``forward`` with the same arguments, hands the
    recomputed mixer the same context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import Layout
from seqpar.sequence_parallel.masks import SequenceMask

if TYPE_CHECKING:
    import torch

CONTEXT_KEY = "seqpar_context"
"""The keyword under which the ``CallContext`` reaches the layers."""


@dataclass(frozen=True)
class CallContext:
    """One prepared-model call as its attention and mixers see it."""

    mesh: SequenceParallelMesh
    """The sequence-parallel mesh."""
    strategy: str
    """The attention strategy asked for."""
    layout: Layout
    """The layout of this call's shards."""
    kernel: str
    """The local attention kernel asked for."""
    mask: SequenceMask
    """The batch's documents, window and blocks."""
    choices: dict
    """Layer index -> ``AttentionChoice`` of its last call, read by ``last_attention_choice``."""
    attended: set = field(default_factory=set)
    """``id`` of each attention module that is running and has called seqpar's attention (Note [attention went
    through seqpar])."""
    positions: torch.Tensor | None = None
    """This rank's global position ids as the call gave them, for a position table that its family's decoder
    does not hand them to (Note [attention adapters]); None where the call had none."""
    width: int | None = None
    """The rows' global width before ``shard_batch``'s layout padding, where the call gave it (``seqpar_width``):
    a sparse-attention indexer ranks that many keys (Note [indexed attention]); None: the whole call."""
    block_layers: tuple[str, ...] | None = None
    """The layer types that take the mask's image blocks (``Family.image_block_layers``); None: every layer."""
    cache: dict = field(default_factory=dict)
    """Tensors made once per call for every layer that asks (the visibility of Note [indexed attention])."""


def adapter_context(module: object, cache: object | None, kwargs: dict, *, silu: bool = True) -> CallContext:
    """The call context a mixer adapter (Note [mixer adapters]) was handed, after checking what it cannot serve.

    Args:
        module: the adapted mixer.
        cache: its ``cache`` argument (seqpar trains without one).
        kwargs: its keyword arguments, the context among them.
        silu: the adapter applies silu after its convolution: check that the module's activation is that.

    Returns:
        The ``CallContext``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or with another activation.
    """
    from seqpar.errors import SeqparInputError

    name = type(module).__name__
    ctx = kwargs.get(CONTEXT_KEY)
    if ctx is None or cache is not None:
        raise SeqparInputError(f"a seqpar-adapted {name} runs inside a prepared model's call, without a cache")
    activation = getattr(module, "activation", "silu")
    if silu and activation not in ("silu", "swish"):
        raise SeqparInputError(f"{name}'s convolution activation is {activation!r}; seqpar's adapter applies silu")
    return ctx
