"""seqpar: sequence parallelism for long-context transformer training (Ulysses, ring, all-gather attention).

The public API: ``make_mesh``, ``shard_sequence``, ``gather_sequence``, ``position_ids``, ``attention``.
"""

from seqpar.api import attention, resolve_strategy
from seqpar.errors import SeqparInputError
from seqpar.kernels import select_kernel
from seqpar.layout import LAYOUTS, gather_sequence, position_ids, shard_sequence
from seqpar.masking import SequenceMask, sequence_mask
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh, make_mesh
from seqpar.validation import STRATEGIES

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "SeqparInputError",
    "SequenceMask",
    "SequenceParallelMesh",
    "as_sp_mesh",
    "attention",
    "gather_sequence",
    "make_mesh",
    "position_ids",
    "resolve_strategy",
    "select_kernel",
    "sequence_mask",
    "shard_sequence",
]

__version__ = "0.1.0"
