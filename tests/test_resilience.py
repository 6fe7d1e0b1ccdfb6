"""``seqpar train`` under preemption, faults and changed layouts: real processes, real signals, real files.

Independent runs start together (``Popen``) to keep the wall time down; each case checks what a user sees:
exit codes, the lines printed, the checkpoints left on disk and the losses after resuming.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.errors import SeqparInputError
from seqpar.runtime.spawn import spawn_ranks, start_method_for
from tests._commands import Command, seqpar_command
from tests.test_train_cli import TINY, losses

QUIET = [*TINY, "--no-progress"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "seqpar.cli", "train"]


def start(*args: str, torchrun: bool = False) -> subprocess.Popen | Command:
    """Start ``seqpar train`` (forked from the session's command server: Note [forked commands]) or torchrun's;
    stderr goes to a file, so reading stdout line by line can never block it."""
    stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by finish()
    if torchrun:
        command = [*TORCHRUN, *QUIET, *args]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    else:
        process = seqpar_command(["train", *QUIET, *args], stdout=subprocess.PIPE, stderr=stderr)
    process.stderr_file = stderr
    return process


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    """Wait for ``process``; its exit code, the stdout not read yet and its whole stderr."""
    out = process.stdout.read()  # through the same buffer that read_until used: no line is lost
    code = process.wait(timeout=timeout)
    with process.stderr_file as err:
        err.seek(0)
        return code, out, err.read()


def read_until(process: subprocess.Popen, pattern: str, seen: list[str]) -> str:
    """Read ``process``'s stdout lines (kept in ``seen``) until one matches ``pattern``; return that line."""
    for line in process.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return line
    process.wait()
    process.stderr_file.seek(0)
    raise AssertionError(f"{pattern!r} never printed; output:\n{''.join(seen)}\n{process.stderr_file.read()}")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def rank_pids(launcher: int) -> list[int]:
    """The rank processes of a ``seqpar train`` that started its own (not multiprocessing's resource tracker)."""
    found = []
    for pid in children(launcher):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():  # forked ranks have the launcher's command line
                found.append(pid)
    return found


def torchrun_rank_pid(torchrun: int, rank: int) -> int:
    for pid in children(torchrun):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under torchrun {torchrun}")


def checkpoints(run_dir) -> list[str]:
    return sorted(os.listdir(run_dir / "checkpoints"))


def assert_same_losses(got: dict, want: dict, steps: range, rel: float, what: str) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=rel, abs=1e-7), (what, step, got, want)


def assert_resumed(process: subprocess.Popen, run_dir, written: str, ref, steps: range) -> None:
    """A resumed run ended well, said what it resharded from, and repeated ``ref``'s losses and grad norms."""
    code, out, err = finish(process)
    assert code == 0, (run_dir.name, err)
    assert f"(written at {written}" in out, (run_dir.name, out)
    assert sorted(losses(run_dir)) == list(steps), run_dir.name
    # float rounding only: the attention and the sums are split differently (as sp 1 vs sp 2 from step 0)
    for key in ("loss", "grad_norm"):
        assert_same_losses(losses(run_dir, key), losses(ref, key), steps, 1e-5, f"{run_dir.name} {key}")


def test_preemption_then_resume_here_and_on_other_layouts(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    reference = start("--steps", "8", "--save-every", "4", "--run-dir", str(ref))
    stopped = start("--steps", "8", "--save-every", "0", "--run-dir", str(cut))
    seen: list[str] = []
    read_until(stopped, r"^step 1/8", seen)
    stopped.send_signal(signal.SIGTERM)
    # a second signal while the checkpoint is being written changes nothing: the save is not cut short
    read_until(stopped, r"^stop requested", seen)
    stopped.send_signal(signal.SIGINT)
    code, out, err = finish(stopped)
    out = "".join(seen) + out
    assert code == 0, err  # SIGTERM came first: a clean preemption
    done = int(re.search(r"stopped by SIGTERM after step (\d) of 8", out).group(1))
    assert 2 <= done < 8, out
    assert f"--run-dir {cut} --resume auto" in out
    assert checkpoints(cut) == [f"step_{done:07d}"]  # one checkpoint, complete (no .partial left)
    assert "eval.json" not in os.listdir(cut)
    assert finish(reference)[0] == 0
    curve = losses(ref)

    # resumed in place, the same layout: every step equals the run never stopped
    resumed = start("--steps", "8", "--run-dir", str(cut), "--resume", "auto")
    # elastic: the sp 2 checkpoint of step 4 continued on 4 ranks, and on dp 2 x sp 2 with FSDP2 sharding (half
    # the batch per replica: the same global batch); on 1 rank below, from the FSDP2 shards
    step4 = str(ref / "checkpoints" / "step_0000004")
    layouts = {
        "sp4": ["--sp", "4"],
        "dp2sp2fsdp": ["--sp", "2", "--dp", "2", "--batch-size", "1", "--grad-accum", "1", "--dp-mode", "fsdp"],
    }
    others = {
        name: start("--steps", "8", "--run-dir", str(tmp_path / name), "--resume", step4, *extra, "--save-every", "2")
        for name, extra in layouts.items()
    }
    code, out, err = finish(resumed)
    assert code == 0, err
    assert f"resumed from {cut}/checkpoints/step_{done:07d} at step {done}" in out
    assert_same_losses(losses(cut), curve, range(1, 9), 1e-6, "resumed in place")
    assert_same_losses(losses(cut, "answer_loss"), losses(ref, "answer_loss"), range(1, 9), 1e-6, "answers")
    for name, process in others.items():
        assert_resumed(process, tmp_path / name, "dp 1 x sp 2 x tp 1, replicate; resharded to", ref, range(5, 9))
    # and back: the FSDP2 shards that dp 2 x sp 2 wrote at step 6, continued replicated on one rank
    fsdp6 = str(tmp_path / "dp2sp2fsdp" / "checkpoints" / "step_0000006")
    back = start("--steps", "8", "--sp", "1", "--run-dir", str(tmp_path / "back"), "--resume", fsdp6)
    wrote = "dp 2 x sp 2 x tp 1, fsdp; resharded to dp 1 x sp 1 x tp 1, replicate)"
    assert_resumed(back, tmp_path / "back", wrote, ref, range(7, 9))
    check_refusals(ref / "checkpoints" / "step_0000004", tmp_path)


def _rewrite_marker(checkpoint) -> None:
    """Record the files' current sizes in the completion marker, as a tamperer who knows the format would."""
    marker = checkpoint / "seqpar_complete.json"
    meta = json.loads(marker.read_text())
    meta["files"] = {name: os.path.getsize(checkpoint / name) for name in meta["files"]}
    marker.write_text(json.dumps(meta))


class _Payload:
    """Unpickling this writes ``path``: the proof that a loader ran code from the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _state(hidden: int) -> dict:
    """What the trainer loads a checkpoint into, for the TINY model at ``hidden`` width (one process)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from seqpar.train.config import TrainConfig
    from seqpar.train.model import build_model

    model = build_model(TrainConfig(hidden_size=hidden, layers=1, heads=2, seq_len=192), 258)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict()}


def check_refusals(source, tmp_path) -> None:
    """Checkpoints that would run code, and one of another model shape, are refused with clear errors."""
    from seqpar.train.checkpoint import load_checkpoint, read_metadata

    assert load_checkpoint(str(source), _state(32)) == 4  # the untouched checkpoint loads in one process
    with pytest.raises(SeqparInputError, match=r"different model shape: .*is \[258, 32\] in the checkpoint but"):
        load_checkpoint(str(source), _state(64))

    # .metadata replaced by a pickle that runs code when unpickled
    evil = tmp_path / "evil_meta"
    shutil.copytree(source, evil)
    proof = tmp_path / "metadata_ran"
    (evil / ".metadata").write_bytes(pickle.dumps(_Payload(str(proof))))
    _rewrite_marker(evil)
    with pytest.raises(SeqparInputError, match=r"unsafe or unreadable .*refused to load builtins.exec"):
        load_checkpoint(str(evil), _state(32))
    assert not proof.exists()
    with open(evil / ".metadata", "rb") as f:  # control: the payload is live under the plain unpickler
        pickle.load(f)
    assert proof.read_text() == "ran"

    # a non-tensor value (the schedule's step) replaced by a torch.save pickle that runs code
    evil = tmp_path / "evil_value"
    shutil.copytree(source, evil)
    proof = tmp_path / "value_ran"
    metadata = read_metadata(str(evil))
    key = next(k for k in metadata.storage_data if k.fqn == "scheduler.last_epoch")
    info = metadata.storage_data[key]
    with open(evil / info.relative_path, "ab") as f:
        offset = f.tell()
        torch.save(_Payload(str(proof)), f)
        length = f.tell() - offset
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=length)
    (evil / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_marker(evil)
    with pytest.raises(SeqparInputError, match=r"scheduler.last_epoch is not plain data"):
        load_checkpoint(str(evil), _state(32))
    assert not proof.exists()
    with open(evil / info.relative_path, "rb") as f:  # control: torch.load's full unpickler runs it
        f.seek(offset)
        torch.load(io.BytesIO(f.read(length)), weights_only=False)
    assert proof.read_text() == "ran"


def _stall_then_one_rank_raises(rank: int, world_size: int) -> None:
    from seqpar.runtime.progress import RankProgress

    dist.all_reduce(torch.ones(1))  # every rank is up and talking
    # rank 2 stalls while ranks 0 and 1 wait for it, in different phases, with a 2 s timeout
    short = dist.new_group(timeout=timedelta(seconds=2))
    progress = RankProgress()
    progress.mark("gathering the metrics of step 5" if rank == 1 else "optimizer step 5")
    judged = ["test/judged/0", "test/judged/1"]
    if rank == 2:  # stalled until the others have timed out and named it (past their grace period)
        progress.store.wait(judged, timedelta(seconds=60))
    else:
        # the first rank to time out closes its connections, so the other may fail with a lost peer instead
        with pytest.raises(RuntimeError, match=r"(?i)timed out|connection closed"):
            dist.all_reduce(torch.ones(1), group=short)
        said = progress.stalled(grace_s=3.0)
        want = "rank 2 is stalled or dead: not waiting on the others (last reported optimizer step 5)"
        phase = "gathering the metrics of step 5" if rank == 0 else "optimizer step 5"
        other = f"rank {1 - rank} failed waiting too, in {phase}"
        assert said.startswith(want) and other in said and "every rank" not in said, said
        progress.store.set(judged[rank], "named rank 2")
    dist.barrier()  # the default group, with its long timeout, is untouched
    if rank == 1:
        raise ValueError("row 17 of shard 1 is not valid UTF-8")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that has failed


def three_ranks_name_the_stalled_one() -> None:
    """Ranks that time out name the stalled rank (store-level, 3 ranks); then an exception on one rank only ends
    the ranks waiting for it, with that error named. Run in a process of its own, beside a stalled run's wait."""
    began = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="ValueError: row 17 of shard 1") as raised:
        # forked from this process as seqpar's launcher forks them (Note [forked ranks]): no import per rank
        spawn_ranks(_stall_then_one_rank_raises, 3, timeout=timedelta(minutes=5), start_method=start_method_for("gloo"))
    assert raised.value.error_index == 1
    assert time.monotonic() - began < 60  # far below the collective timeout: no hang


def test_faults_end_every_rank_promptly_and_say_why(tmp_path):
    # 3 ranks, one stalled then one raising, in a process of its own while the runs below wait
    check = "from tests.test_resilience import three_ranks_name_the_stalled_one as check; check()"
    root = pathlib.Path(__file__).resolve().parent.parent
    piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    three = subprocess.Popen([sys.executable, "-c", check], cwd=root, **piped)
    # a stalled rank: the other one gives up after --timeout-s and says where it was
    stall = start("--steps", "2000", "--timeout-s", "10", "--run-dir", str(tmp_path / "stall"))
    # torchrun: SIGTERM to torchrun reaches every rank, which stop after the step with one checkpoint
    preempted = start("--steps", "2000", "--save-every", "0", "--run-dir", str(tmp_path / "tr"), torchrun=True)
    read_until(stall, r"^step 2/2000", [])  # frozen first: its ranks train no further steps while torchrun starts
    other, frozen = sorted(rank_pids(stall.pid))  # ranks 0 and 1, spawned in that order
    os.kill(frozen, signal.SIGSTOP)
    read_until(preempted, r"^step 2/2000", [])
    preempted.send_signal(signal.SIGTERM)
    # while rank 0 of the stalled run waits out its --timeout-s: the torchrun cases
    code, out, err = finish(preempted)
    # torchrun passes the SIGTERM on to its workers, waits for them, then re-raises it (exit code 1)
    assert "stopped by SIGTERM after step" in out, (out, err)
    assert "Received 15 death signal, shutting down workers" in err, err
    stop_step = int(re.search(r"stopped by SIGTERM after step (\d+) of 2000", out).group(1))
    assert checkpoints(tmp_path / "tr") == [f"step_{stop_step:07d}"]

    # torchrun: one rank SIGKILLed ends the run within seconds, naming the rank
    resumed = start("--steps", "2000", "--run-dir", str(tmp_path / "tr"), "--resume", "auto", torchrun=True)
    read_until(resumed, rf"^step {stop_step + 2}/2000", [])
    os.kill(torchrun_rank_pid(resumed.pid, 1), signal.SIGKILL)
    killed = time.monotonic()
    code, out, err = finish(resumed)
    assert time.monotonic() - killed < 15
    assert code != 0 and "Signal 9 (SIGKILL) received by PID" in err, err
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", err), err

    # the stalled run: rank 0 gave up and said where it was
    while os.path.exists(f"/proc/{other}"):
        time.sleep(0.2)
    # its pending SIGTERM from the launcher, then its lost peer, end it; unless the launcher's grace ran out first
    # while the torchrun cases ran, and it was killed
    with contextlib.suppress(ProcessLookupError):
        os.kill(frozen, signal.SIGCONT)
    code, out, err = finish(stall)
    assert code == 1, out
    assert re.search(
        r"failed on rank 0: RuntimeError: rank 0 failed while (optimizer step|gathering the metrics of step|saving "
        r"the checkpoint of step) \d+ \(no answer from the other ranks within --timeout-s 10; rank 1 is stalled or "
        r"dead: not waiting on the others \(last reported (optimizer step|gathering the metrics of step|saving the "
        r"checkpoint of step) \d+\)\)",
        err,
    ), err

    output, _ = three.communicate(timeout=120)
    assert three.returncode == 0, output


def _report_start(rank: int, world_size: int, where: str) -> None:
    """What a rank starts with: its signal handlers and its first random number (Note [forked ranks])."""
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    started = {"handlers": handlers == (signal.SIG_DFL, signal.default_int_handler), "draw": torch.rand(3)}
    with open(os.path.join(where, f"{rank}.pt"), "wb") as f:
        torch.save(started, f)


def test_forked_ranks_start_as_spawned_ones_do(tmp_path):
    """A forked rank gets a fresh process's handlers and its own generator, though its launcher had others."""
    from seqpar.runtime.spawn import start_method_for

    assert start_method_for("nccl") == "spawn"  # CUDA contexts do not survive a fork
    # a fresh launcher may fork; this one may hold threads left by earlier tests, so ask a fresh one
    asked = "from seqpar.runtime.spawn import start_method_for; print(start_method_for('gloo'))"
    fresh = subprocess.run([sys.executable, "-c", asked], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == ("fork" if sys.platform == "linux" else "spawn")
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:  # a thread holding a lock at fork time would leave the copy's lock held forever
        assert start_method_for("gloo") == "spawn"
    finally:
        release.set()
        other.join()
    with pytest.raises(ValueError, match="start_method"):
        spawn_ranks(_report_start, 1, str(tmp_path), start_method="forkserver")
    for method in ("spawn", "fork"):
        (tmp_path / method).mkdir()
        launcher = torch.get_rng_state()
        spawn_ranks(_report_start, 2, str(tmp_path / method), forward_signals=True, start_method=method)
        started = [torch.load(tmp_path / method / f"{r}.pt") for r in range(2)]
        torch.set_rng_state(launcher)
        continued = torch.rand(3)  # what a copy of the launcher's generator would draw
        assert all(s["handlers"] for s in started), method
        draws = [continued, *(s["draw"] for s in started)]
        assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :]), (method, draws)
