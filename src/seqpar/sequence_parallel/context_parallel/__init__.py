"""``seqpar.context_parallel``: torch's ``context_parallel`` context manager, served by seqpar's attention.

Buffers are sharded in place on entry and restored on exit; SDPA calls inside run through ``seqpar.attention``.
"""

from seqpar.sequence_parallel.context_parallel.context_manager import context_parallel, context_parallel_unshard

__all__ = ["context_parallel", "context_parallel_unshard"]
