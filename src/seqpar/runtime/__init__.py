"""What the applications (``seqpar train``, ``seqpar bench``, the tests) share to run: process memory readings."""

from seqpar.runtime.memory import PeakMemory, reset_resident_peak, resident_mb

__all__ = ["PeakMemory", "reset_resident_peak", "resident_mb"]
