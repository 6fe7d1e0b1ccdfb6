"""What the applications (``seqpar train``, ``seqpar bench``, the tests) share to run: spawning ranks, reading the
memory of a process, stopping cleanly on SIGTERM/SIGINT.
"""

from seqpar.runtime.memory import PeakMemory, reset_resident_peak, resident_mb
from seqpar.runtime.progress import RankProgress
from seqpar.runtime.signals import STOP_SIGNALS, StopSignals, exit_code_for
from seqpar.runtime.spawn import spawn_ranks

__all__ = [
    "STOP_SIGNALS",
    "PeakMemory",
    "RankProgress",
    "StopSignals",
    "exit_code_for",
    "reset_resident_peak",
    "resident_mb",
    "spawn_ranks",
]
