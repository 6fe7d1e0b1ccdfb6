"""``seqpar.context_parallel``: torch's ``context_parallel`` context manager, served by seqpar's attention.

Buffers are sharded in place on entry and restored on exit; SDPA and ``seqpar.flex_attention`` calls inside run
through ``seqpar.attention``.
"""

from seqpar.sequence_parallel.context_parallel.context_manager import context_parallel, context_parallel_unshard
from seqpar.sequence_parallel.context_parallel.flex_mode import flex_attention, softcap_score_mod

__all__ = ["context_parallel", "context_parallel_unshard", "flex_attention", "softcap_score_mod"]
