"""SIGTERM and SIGINT turned into a request to stop at the next safe point, instead of an immediate death.

The trainer's ranks check the request after each optimizer step; a launcher passes the signal on to its ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(received: signal.Signals | None) -> int:
    """The exit code of a run stopped cleanly by ``received``: 0 for SIGTERM (and none), 130 for SIGINT.

    SIGTERM is how schedulers preempt a job that did what it was asked; Ctrl-C keeps the shell's 128 + 2.
    """
    return 130 if received == signal.SIGINT else 0


class StopSignals:
    """While installed, SIGTERM and SIGINT are recorded (and passed on to ``forward_to()``'s processes).

    The first signal sets ``received``; later ones are passed on but change nothing else, so a
    second Ctrl-C cannot interrupt the checkpoint being written. The previous handlers come back on exit.
    Outside the main thread (where Python cannot install handlers) it installs nothing.
    """

    def __init__(self, forward_to: Callable[[], list[int]] | None = None) -> None:
        """Record signals from ``__enter__`` to ``__exit__``.

        Args:
            forward_to: returns the process ids to pass each signal on to (a launcher's ranks); None: none.
        """
        self.forward_to = forward_to
        self.received: signal.Signals | None = None
        """The first signal received, or None."""
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        for pid in self.forward_to() if self.forward_to else []:
            with contextlib.suppress(ProcessLookupError):  # that rank has already finished
                os.kill(pid, signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
