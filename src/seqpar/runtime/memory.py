"""Peak memory of this process, as the benchmarks and the trainer report it.

On the CPU: the resident set read from Linux's /proc (VmRSS now, VmHWM its peak); on CUDA: the allocator peak.
Also the bytes this process has written, sockets included, for the benchmarks and tests that count traffic.
"""

from __future__ import annotations

import contextlib

import torch


def resident_mb(field: str = "VmRSS", default: float | None = None) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset) of this process, in MiB.

    Args:
        field: the /proc/self/status field.
        default: returned instead of raising when the field cannot be read.

    Raises:
        OSError: no /proc (not Linux), unless ``default`` is given.
        RuntimeError: the field is not in /proc/self/status, unless ``default`` is given.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"{field} not in /proc/self/status")
    except (OSError, RuntimeError):
        if default is None:
            raise
        return default


def reset_resident_peak() -> None:
    """Set VmHWM back to the current resident set (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakMemory:
    """Peak memory over an interval: allocator peak on CUDA, resident-set peak on the CPU (0 without /proc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        """Start a new interval."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):
            reset_resident_peak()

    def peak_mb(self) -> float:
        """The peak since ``reset``, in MiB."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return resident_mb("VmHWM", default=0.0)


def written_bytes() -> int:
    """Bytes this process has written so far (sockets included), as the kernel counts them (``/proc/self/io``).

    Returns:
        The ``wchar`` counter.

    Raises:
        RuntimeError: the counter cannot be read (not Linux).
    """
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")
