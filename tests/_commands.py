"""``seqpar`` commands run as a user runs them, but forked from one process that imported their libraries once.

Note [forked commands]
~~~~~~~~~~~~~~~~~~~~~~
A ``python -m seqpar.cli train`` spends about 4 s of a core importing torch, transformers, matplotlib and
TensorBoard before it reads its arguments, and the suite starts some forty of them. The session's command server
(tests/_command_server.py) imports all of it once and forks a copy per command: the copy takes the caller's
arguments, working directory, environment and standard streams, runs ``seqpar.cli.main`` and exits with its code,
as the console script does. Its pid is the command's own, so signals and /proc reach it as they reach a
``Popen``'s, and its ranks are its own forks. What only a fresh interpreter shows (the entry point, the imports a
command makes on first use) stays tested by real subprocesses: tests/test_imports.py, the fresh ``seqpar train``
run of tests/test_train_cli.py and the torchrun launches.
"""

from __future__ import annotations

import array
import json
import os
import pathlib
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

__all__ = ["Command", "CommandServer", "seqpar_command", "use_commands"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180


class Command:
    """A ``seqpar`` command forked by the server, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, args: list[str], conn: socket.socket, stdout: IO | None, stderr: IO | None) -> None:
        self.args, self.stdout, self.stderr, self.returncode = args, stdout, stderr, None
        self._conn, self._received = conn, b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str:
        """The server's next line about this command: its pid, then its exit code."""
        self._conn.settimeout(timeout)
        while b"\n" not in self._received:
            try:
                chunk = self._conn.recv(64)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the tests' command server ended while {self.args} ran")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None and (b"\n" in self._received or select.select([self._conn], [], [], 0)[0]):
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the piped streams to their end, then wait for the command (as ``Popen.communicate``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = {f: [] for f in (self.stdout, self.stderr) if f is not None}
        with selectors.DefaultSelector() as selector:
            for f in pipes:
                selector.register(f, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                    if chunk:
                        pipes[key.fileobj].append(chunk)
                    else:
                        selector.unregister(key.fileobj)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        texts = {f: b"".join(parts).decode() for f, parts in pipes.items()}
        for f in pipes:
            f.close()
        return texts.get(self.stdout), texts.get(self.stderr)


class CommandServer:
    """The session's command server (Note [forked commands]), started by its first command."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="seqpar-commands-")
        self._path = os.path.join(self._dir, "server.sock")
        self._server: subprocess.Popen | None = None

    def run(self, argv: list[str], stdout: Any = None, stderr: Any = None, cwd: str | None = None) -> Command:
        """Start ``seqpar *argv``; ``stdout`` / ``stderr``: ``subprocess.PIPE``, a file, or None (this process's)."""
        conn = self._connect()
        ends, mine = [os.open(os.devnull, os.O_RDONLY)], {}
        for name, target, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                mine[name] = open(read)  # noqa: SIM115 - closed by communicate, or by the test
                ends.append(write)
            else:
                ends.append(target.fileno() if target is not None else default)
        request = {"argv": list(argv), "cwd": cwd or os.getcwd(), "env": dict(os.environ)}
        conn.sendmsg([json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", ends))])
        for fd, target in zip(ends, (None, stdout, stderr), strict=True):
            if fd > 2 and (target is None or target == subprocess.PIPE):  # this process's copies of the new ends
                os.close(fd)
        return Command([sys.executable, "-m", "seqpar.cli", *argv], conn, mine.get("stdout"), mine.get("stderr"))

    def _connect(self) -> socket.socket:
        if self._server is None:
            command = [sys.executable, "-u", "-m", "tests._command_server", self._path]
            self._server = subprocess.Popen(command, stdin=subprocess.PIPE, cwd=ROOT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if self._server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the tests' command server did not start (exit {self._server.poll()})"
                    ) from None
                time.sleep(0.05)

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
            self._server = None
        shutil.rmtree(self._dir, ignore_errors=True)


_servers: list[CommandServer] = []  # the session's server (tests/conftest.py), empty outside a pytest session


def use_commands(server: CommandServer | None) -> None:
    """Make ``seqpar_command`` fork from ``server`` (None: start a fresh interpreter for every command again)."""
    _servers.clear()
    if server is not None:
        _servers.append(server)


def seqpar_command(argv: list[str], stdout: Any = None, stderr: Any = None) -> Command | subprocess.Popen:
    """``seqpar *argv`` started now: forked by the session's server, or a fresh interpreter outside a session."""
    if _servers:
        return _servers[0].run(argv, stdout=stdout, stderr=stderr)
    command = [sys.executable, "-m", "seqpar.cli", *argv]
    return subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
