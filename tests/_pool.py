"""A pool of live ranks that runs many functions one after another: start and join a process group once, reuse it.

The tests run hundreds of small multi-rank cases; starting processes and importing torch dominates each fresh spawn.
The ranks are forked by multiprocessing's forkserver, which imported ``PRELOADED`` once: a pool starts at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.runtime.progress import lost_peer

__all__ = ["RankPool", "RankPoolTimeout"]

PRELOADED = ("tests._pool", "transformers", "seqpar", "tests._models")
"""What the ranks' forkserver imports before it forks any: a rank starts as its copy, without importing them."""


class RankPoolTimeout(TimeoutError):
    """A function on the pool's ranks did not finish in time; the pool was torn down."""


@dataclass(frozen=True)
class _FreshState:
    """What a fresh rank starts with, put back before each function so that their order does not matter."""

    dtype: torch.dtype
    seed: int
    deterministic: bool
    deterministic_warn_only: bool
    matmul_precision: str
    cwd: str
    env: dict[str, str]

    @classmethod
    def read(cls) -> _FreshState:
        return cls(
            dtype=torch.get_default_dtype(),
            seed=torch.initial_seed(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            matmul_precision=torch.get_float32_matmul_precision(),
            cwd=os.getcwd(),
            env=dict(os.environ),
        )

    def restore(self, threads: int) -> None:
        torch.set_default_dtype(self.dtype)
        torch.manual_seed(self.seed)  # a fresh process's generator starts from this seed
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_num_threads(threads)
        os.chdir(self.cwd)
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)


@contextlib.contextmanager
def _captured_output() -> Iterator[list[str]]:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to a file; yield a list that gets the text."""
    text: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


def _destroy_new_groups(before: set) -> None:
    """Destroy the process groups a function made (meshes make sub-groups), so their sockets do not pile up.

    DTensor memoises sharding propagation and redistribution plans by value, and a ``DeviceMesh`` equals any other
    mesh of the same ranks, shape and names; a later function's mesh would then be handed the plans, and through
    them the groups, of a mesh destroyed here. Those caches are cleared with the groups, as a fresh process has them.
    """
    world = dist.distributed_c10d._world  # torch keeps no public list of the live groups
    new = [g for g in world.pg_map if g not in before and g is not dist.group.WORLD]
    for group in new:
        with contextlib.suppress(Exception):  # a group the function destroyed itself, or one of another backend
            dist.destroy_process_group(group)
    if new:
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's value-keyed caches of sharding and redistribution plans (which hold meshes, hence groups)."""
    if "torch.distributed.tensor" not in sys.modules:  # never used here: nothing cached, nothing to import
        return
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (
        propagator.propagate_op_sharding,
        propagator._propagate_tensor_meta_cached,
        _redistribute._gen_transform_infos,
        _collective_utils.MeshTopoInfo.build_from_mesh,
    ):
        with contextlib.suppress(AttributeError):  # a torch release that does not cache this one
            cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's cache
    if clear_native is not None:
        clear_native()


def _run_one(conn: multiprocessing.connection.Connection, fresh: _FreshState, rank: int, world_size: int, threads: int):
    """Receive one function, run it on this rank with the fresh state, send back ("ok" | "error", text, output)."""
    payload = conn.recv_bytes()
    if not payload:
        return False
    fresh.restore(threads)
    groups = set(dist.distributed_c10d._world.pg_map)
    status, trace = "ok", ""
    with _captured_output() as output:
        try:
            fn, args = pickle.loads(payload)
            fn(rank, world_size, *args)
            dist.barrier()  # every rank is done talking before the next function starts
            _destroy_new_groups(groups)
        except BaseException:  # reported to the parent, which tears the pool down; a peer may wait in a collective
            status, trace = "error", traceback.format_exc()
    conn.send((status, trace, output[0]))
    return True


def _pool_entry(
    rank: int,
    world_size: int,
    conn: multiprocessing.connection.Connection,
    store: str,
    backend: str,
    timeout: timedelta,
    threads: int,
) -> None:
    torch.set_num_threads(threads)  # ranks share the machine's cores
    dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"file://{store}", timeout=timeout)
    fresh = _FreshState.read()
    conn.send(("ready", "", ""))
    with contextlib.suppress(EOFError, OSError):  # the parent went away: leave
        while _run_one(conn, fresh, rank, world_size, threads):
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no C++ static destructors: gloo's threads have aborted finished processes there (see spawn_ranks)


class RankPool:
    """``world_size`` ranks of one process group (forked, see the module's note), started on first use, that run
    functions one at a time.

    Each function runs on every rank as ``fn(rank, world_size, *args)`` with a fresh process's torch state (default
    dtype, random seed, grad mode, deterministic flags, working directory, environment); a barrier follows it and the
    process groups it made are destroyed. A function that fails on any rank (an exception, a rank that dies, or no
    answer within ``deadline``) tears the pool down, since its peers may be stuck in a collective; the next call
    starts a new one. Functions that change what the state reset does not cover (they init their own group, rely on
    a process's first use of a library, test faults) belong in ``spawn_ranks``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=2),
        threads: int = 1,
        grace: timedelta = timedelta(seconds=5),
    ) -> None:
        """Args:
        world_size: number of ranks.
        backend: the process group's backend ("gloo"; "nccl" puts rank r on GPU r).
        timeout: how long a collective waits for the other ranks before it fails.
        threads: torch intra-op threads per rank.
        grace: how long the other ranks may take to answer once one rank has failed.
        """
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.threads = threads
        self.grace = grace
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store_dir: str | None = None

    @property
    def alive(self) -> bool:
        """Whether the pool's ranks are running (a call starts them otherwise)."""
        return bool(self._processes)

    def start(self) -> None:
        """Start the ranks and wait until each has joined the process group (a no-op when they run)."""
        if self._processes:
            return
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOADED))  # before the process's forkserver starts, its first use
        self._store_dir = tempfile.mkdtemp(prefix="seqpar-pool-")
        store = os.path.join(self._store_dir, "store")
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            args = (rank, self.world_size, child, store, self.backend, self.timeout, self.threads)
            process = context.Process(target=_pool_entry, args=args, name=f"seqpar-pool-{self.world_size}-{rank}")
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        self._collect(deadline=self.timeout + timedelta(minutes=1), what="joining the process group")

    def run(self, fn: Callable[..., None], *args: object, deadline: timedelta | None = timedelta(minutes=15)) -> None:
        """Call ``fn(rank, world_size, *args)`` on every rank of the pool; return when every rank has succeeded.

        Args:
            fn: a module-level function (pickled by name).
            *args: further arguments of ``fn``; they must pickle.
            deadline: the longest the call may take (None: no limit).

        Raises:
            torch.multiprocessing.ProcessRaisedException: a rank raised; ``error_index`` is the rank and the message
                ends with its traceback (a rank that failed by itself rather than a peer that lost it).
            torch.multiprocessing.ProcessExitedException: a rank died without raising.
            RankPoolTimeout: some rank did not finish within ``deadline``.
        """
        self.start()
        payload = pickle.dumps((fn, args))
        for conn in self._conns:
            conn.send_bytes(payload)
        self._collect(deadline=deadline, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, deadline: timedelta | None, what: str) -> None:
        """Wait for one answer from every rank; on any failure tear the pool down and raise the root cause."""
        answers: dict[int, tuple[str, str, str]] = {}
        failures: list[tuple[int, str, str]] = []  # (rank, kind, text) in the order they came
        end = None if deadline is None else time.monotonic() + deadline.total_seconds()
        failed_at = 0.0
        while len(answers) < self.world_size:
            if failures:
                end = min(end or float("inf"), failed_at + self.grace.total_seconds())
            left = None if end is None else max(0.0, end - time.monotonic())
            waiting = [r for r in range(self.world_size) if r not in answers]
            ready = multiprocessing.connection.wait(
                [self._conns[r] for r in waiting] + [self._processes[r].sentinel for r in waiting], timeout=left
            )
            if not ready:
                break
            for rank in waiting:
                answer = self._answer(rank, ready)
                if answer is None:
                    continue
                answers[rank] = answer
                if answer[0] != "ok" and answer[0] != "ready":
                    if not failures:
                        failed_at = time.monotonic()
                    failures.append((rank, answer[0], answer[1]))
        self._echo(answers)
        if failures or len(answers) < self.world_size:
            self.close(kill=True)
            raise self._error(failures, [r for r in range(self.world_size) if r not in answers], what)

    def _answer(self, rank: int, ready: list) -> tuple[str, str, str] | None:
        conn, process = self._conns[rank], self._processes[rank]
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        elif process.sentinel not in ready:
            return None
        process.join(timeout=5)
        return ("exited", f"exit code {process.exitcode}", "")

    def _echo(self, answers: dict[int, tuple[str, str, str]]) -> None:
        """Print each rank's output in this process (where a test runner captures it)."""
        for rank in sorted(answers):
            if answers[rank][2]:
                sys.stdout.write(f"--- rank {rank} of {self.world_size} ---\n{answers[rank][2]}")
        sys.stdout.flush()

    def _error(self, failures: list[tuple[int, str, str]], silent: list[int], what: str) -> Exception:
        """The exception for the first rank that failed by itself (not one that only lost a peer)."""
        raised = [f for f in failures if f[1] == "error"]
        first = next((f for f in raised if not lost_peer(f[2])), raised[0] if raised else None)
        if first is not None:
            rank, _, trace = first
            message = f"\n\n-- Process {rank:d} terminated with the following error:\n{trace}"
            return mp.ProcessRaisedException(message, rank, 0)
        if failures:
            rank, _, text = failures[0]
            return mp.ProcessExitedException(f"process {rank:d} of the pool died ({text})", rank, 0, -1)
        return RankPoolTimeout(f"{what}: ranks {silent} of {self.world_size} did not answer in time; pool torn down")

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, without waiting for them to leave the group)."""
        for conn in self._conns:
            if not kill:
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"")
        for process in self._processes:
            if not kill:
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
