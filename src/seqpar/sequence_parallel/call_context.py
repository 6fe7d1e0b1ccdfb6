"""What a prepared model's forward hook hands its layers: the mesh, the batch's layout and mask, the strategy.

It travels in the layers' keyword arguments, which transformers passes down to attention and to the mixers.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.layouts.chunks import Layout
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.masks import SequenceMask

__all__ = ["CONTEXT_KEY", "CallContext"]

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
    """Layer index -> ``AttentionChoice`` of its last call, read by ``attention_choice``."""
