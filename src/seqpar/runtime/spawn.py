"""Running a function on N local ranks: start the processes, set up the default process group, tear it down.

``seqpar demo``, ``seqpar train`` without torchrun, the benchmarks and the tests all start their ranks here.

Note [forked ranks]
~~~~~~~~~~~~~~~~~~~
A spawned rank is a fresh interpreter that imports torch, transformers and seqpar before it can do anything;
on a small CPU machine that is most of a short run's time, paid once per rank. A forked rank is a copy of the
launcher, which has imported all of it already while checking the settings. Forking is only safe where the
launcher holds nothing a copy cannot inherit: no CUDA context (CUDA refuses forked children), no other threads
(a lock held by one is never released in the copy), and a POSIX ``fork`` (Linux). ``start_method_for`` checks
that and otherwise answers "spawn". A forked rank starts from a fresh process's signal handlers and a newly
seeded random generator (what a spawned one has), not the launcher's, so the two give the same run. Benchmarks
that measure memory, and tests that need a process's first use of a library, keep "spawn".
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.runtime.progress import lost_peer
from seqpar.runtime.signals import StopSignals

START_METHODS = ("spawn", "fork")


def start_method_for(backend: str | None) -> str:
    """ "fork" where ranks can safely be copies of this process (Note [forked ranks]), else "spawn".

    Args:
        backend: the ranks' process-group backend ("nccl" always spawns: each rank opens its own CUDA context).

    Returns:
        The start method to pass to ``spawn_ranks``.
    """
    safe = (
        sys.platform == "linux"
        and backend != "nccl"
        and not torch.cuda.is_initialized()
        and threading.active_count() == 1
    )
    return "fork" if safe else "spawn"


def _rank_entry(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    args: tuple,
    store: str,
    backend: str | None,
    timeout: timedelta,
    threads: int,
) -> None:
    # a forked rank starts as a spawned one would (Note [forked ranks]): default handlers, a fresh generator
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.seed()  # a fresh process seeds its generator from the operating system's randomness
    # ranks share the machine's cores; more threads per rank than cores per rank only contend
    torch.set_num_threads(threads)
    if backend is None:
        fn(rank, world_size, *args)
    else:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, init_method=f"file://{store}", timeout=timeout
        )
        # A failure propagates at once, the group left standing: tearing it down first closes the peers'
        # connections while this rank still has to report, and the parent then often hears a peer's
        # "connection closed" before the error itself.
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()
    # Leave without running C++ static destructors: gloo's worker threads have been seen to abort the
    # process there ("terminate called without an active exception") after all of its work had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set ``env`` in this process while the block runs (spawned children inherit it), then restore it."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: object,
    backend: str | None = "gloo",
    timeout: timedelta = timedelta(minutes=10),
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    forward_signals: bool = False,
    start_method: str = "spawn",
) -> signal.Signals | None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes, each a rank of a fresh group.

    Each process sets its torch thread count, joins the default process group (a file store in a temporary
    directory), runs ``fn``, waits at a barrier for every rank to finish and destroys the group. Returns when
    every rank has succeeded; the first rank to fail stops the others.

    Args:
        fn: a module-level function (it is pickled by name into the spawned processes).
        world_size: number of ranks (processes).
        *args: further arguments of ``fn``; they must pickle.
        backend: "gloo" (CPU), "nccl" (rank r uses GPU r), or None to run ``fn`` without a process group.
        timeout: how long a collective waits for the other ranks before it fails.
        threads: torch intra-op threads per rank.
        env: environment variables that the spawned processes start with (for settings read at process
            start, such as glibc's ``MALLOC_*``); this process's environment is restored afterwards.
        forward_signals: pass SIGTERM and SIGINT on to the ranks instead of dying of them, and keep waiting
            for the ranks (which decide how to stop); False: this process's own handlers stay.
        start_method: "spawn" (fresh interpreters) or "fork" (copies of this process, which start at once; only
            where ``start_method_for`` allows it: Note [forked ranks]).

    Returns:
        The first SIGTERM or SIGINT passed on to the ranks, or None.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised; ``error_index`` is the rank and the
            message ends with its traceback (the rank that failed first, not a peer that lost it).
        torch.multiprocessing.ProcessExitedException: a rank died without raising (a signal, ``os._exit``).
        ValueError: an unknown ``start_method``.
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, not {start_method!r}")
    pids: list[int] = []
    stop = StopSignals(forward_to=lambda: pids) if forward_signals else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, _environment(env), stop:
        context = mp.start_processes(
            _rank_entry,
            args=(fn, world_size, args, os.path.join(tmp, "store"), backend, timeout, threads),
            nprocs=world_size,
            start_method=start_method,
            join=False,
        )
        pids.extend(context.pids())
        if forward_signals and stop.received is not None:  # it came while the ranks were being started
            for pid in pids:
                os.kill(pid, stop.received)
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as error:
            raise _root_cause(context, error) from None
    return stop.received if forward_signals else None


def _root_cause(context: mp.ProcessContext, error: mp.ProcessRaisedException) -> mp.ProcessRaisedException:
    """The error of a rank that failed by itself, when ``error`` is only another rank losing its connection.

    A rank that raises closes its connections as it exits; a peer waiting in a collective then fails too, and
    the launcher may see that peer first. Every failed rank leaves its traceback in its error file.
    """
    if not lost_peer(str(error)):
        return error
    for rank, path in enumerate(context.error_files):
        if rank == error.error_index or not path or not os.path.isfile(path) or not os.path.getsize(path):
            continue
        with open(path, "rb") as f:
            trace = pickle.load(f)  # a traceback string, written by torch in our own rank process
        if not lost_peer(trace):
            message = f"\n\n-- Process {rank:d} terminated with the following error:\n{trace}"
            return mp.ProcessRaisedException(message, rank, context.processes[rank].pid)
    return error
