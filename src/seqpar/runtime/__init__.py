"""What the applications (``seqpar train``, ``seqpar bench``, the tests) share to run: spawning ranks, reading the
memory of a process, stopping cleanly on SIGTERM/SIGINT.
"""

from seqpar.runtime.signals import StopSignals
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["StopSignals", "spawn_ranks"]
