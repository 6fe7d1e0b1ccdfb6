"""Launches that tests read, run one after another in the background from the session's start (Note [background
launches]); a test waits for the stage it reads and gets that stage's failure, with its output, as its own.

Note [background launches]
    Most of the suite leaves one of the machine's two cores idle much of the time: a test on one process, a
    collective that waits. The Trainer doors' launches (tests/test_hf.py: one-process references, then seqpar's
    runs on 2 to 4 ranks, upstream's launchers) and the sp 2 zoo sweeps (tests/zoo_sweeps.py) are whole
    programs whose results the tests only read, so they are started when the session starts, in a chain on a
    thread, and fill that core while the other tests run.
    A stage runs only if a selected test uses the fixture of its name, so a run of the fast tier or of one file
    starts nothing it does not read. A ``side`` stage is started and left running while the chain goes on (the
    references no launch reads); waiting for it joins it. Each command runs with one thread, as the ranks of
    the pools do, and a failure is kept for the tests that read the stage instead of stopping the chain. The
    commands run at a lower priority (``NICE``): where the tests keep both cores busy the launches yield to them,
    and they take what the tests leave idle. Not the lowest: a launch left a tenth of a core still finishes
    within its timeout.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TIMEOUT_S = 600
NICE = ["nice", "-n", "10"]
"""The launches' priority below the tests' (Note [background launches])."""


@dataclass(frozen=True)
class Stage:
    """Commands run in order; a ``side`` stage is started and left running while the chain goes on."""

    name: str
    commands: Sequence[Sequence[str]]
    side: bool = False


class Chain:
    """The stages of one session, run in order on a thread from ``start``; ``paths``: where they write."""

    def __init__(self, stages: Sequence[Stage], paths: dict[str, pathlib.Path]) -> None:
        self.stages = list(stages)
        self.paths = paths
        """Where the stages write, by name."""
        self.done = {s.name: threading.Event() for s in self.stages}
        self.failures: dict[str, str] = {}
        self.side: dict[str, subprocess.Popen] = {}
        self.running: subprocess.Popen | None = None
        self.closed = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="background launches", daemon=True)

    def start(self) -> Chain:
        self.thread.start()
        return self

    def _popen(self, command: Sequence[str]) -> subprocess.Popen | None:
        with self.lock:  # close() kills what runs; nothing starts after it
            if self.closed:
                return None
            out = subprocess.PIPE
            command = [*NICE, *command]
            self.running = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)
            return self.running

    def _run(self) -> None:
        for stage in self.stages:
            try:
                if stage.side:
                    process = self._popen(stage.commands[0])
                    if process is None:
                        self.failures[stage.name] = "the session closed before it ran"
                    else:
                        self.side[stage.name] = process
                    continue
                for command in stage.commands:
                    failure = self._wait(self._popen(command), command)
                    if failure:
                        self.failures[stage.name] = failure
                        break
            finally:
                self.done[stage.name].set()

    def _wait(self, process: subprocess.Popen | None, command: Sequence[str]) -> str | None:
        if process is None:
            return "the session closed before it ran"
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            return f"{' '.join(command)} ran past {TIMEOUT_S} s:\n{(output or '')[-6000:]}"
        if process.returncode:
            return f"{' '.join(command)} failed:\n{(output or '')[-6000:]}"
        return None

    def wait(self, name: str) -> None:
        """Wait for stage ``name``; raise its failure (AssertionError, with the command's output)."""
        if not self.done[name].wait(timeout=TIMEOUT_S * len(self.stages)):
            raise AssertionError(f"the background stage {name} never finished")
        process = self.side.pop(name, None)  # a side stage: joined by the first test that reads it
        if process is not None:
            failure = self._wait(process, [name])
            if failure:
                self.failures[name] = failure
        if name in self.failures:
            raise AssertionError(f"background stage {name}: {self.failures[name]}")

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for process in [self.running, *self.side.values()]:
                if process is not None and process.poll() is None:
                    process.kill()
