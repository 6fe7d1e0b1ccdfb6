"""Starting ``seqpar train``: under torchrun (one process per rank, NCCL on GPUs) or by spawning gloo CPU ranks.

Settings are checked in the launching process first, so bad input fails before any rank waits on another.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.errors import SeqparInputError
from seqpar.runtime.signals import exit_code_for
from seqpar.runtime.spawn import spawn_ranks, start_method_for
from seqpar.train.checkpoint import latest_checkpoint, verify_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.data import load_tokenizer
from seqpar.train.fit import check_memory
from seqpar.train.model import import_model_code, model_config
from seqpar.train.passkey import PasskeyTask
from seqpar.train.pipeline_config import pipeline_model_check


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _prepare_run_dir(config: TrainConfig) -> str:
    run_dir = config.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    return os.path.abspath(run_dir)


def _precheck(config: TrainConfig, world_size: int) -> object:
    """Checks that need the world size or files (tokenizer, model config, checkpoint), before any rank trains;
    returns the model's transformers config.

    The one check of pp x dp x sp x tp against the world size: here both launchers know it (spawned or torchrun).
    """
    ranks = config.dims().world_size
    if ranks != world_size:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        pp = f"--pp {config.pp} x " if config.pp > 1 else ""
        raise SeqparInputError(
            f"{pp}--dp {config.dp} x --sp {config.sp} x --tp {config.tp} = {ranks} does not match the "
            f"{world_size} ranks (valid sp for {world_size} ranks: {valid} with pp x dp x tp = {world_size} / sp)"
        )
    tokenizer = load_tokenizer(config.tokenizer_path())
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    cfg = model_config(config, vocab)
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if config.tp > 1 and (heads % config.tp or kv_heads % config.tp):
        raise SeqparInputError(
            f"--tp {config.tp} must divide the heads ({heads}) and KV heads ({kv_heads}) of the model"
        )
    pipeline_model_check(config, cfg)
    memory = check_memory(config, cfg)  # raises before any rank trains when --max-memory-mb is exceeded
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(memory, flush=True)
    if config.resume not in (None, "auto"):
        verify_checkpoint(config.resume)
    if not config.data:
        task = PasskeyTask(tokenizer, config.seed)
        for length in [config.seq_len, *(config.eval_lengths or [2 * config.seq_len])]:
            task.example(length, 0)
    multiple = 2 * config.sp
    # shard_batch pads data rows; the synthetic task asks for exact lengths instead
    if config.seq_len % multiple and not config.data:
        raise SeqparInputError(f"--seq-len {config.seq_len} must be a multiple of 2 x sp = {multiple}")
    return cfg


def _rank_main(rank: int, world_size: int, config: TrainConfig, run_dir: str) -> None:
    from seqpar.train.loop import train_rank

    train_rank(config, run_dir)


def launch(config: TrainConfig) -> int:
    """Run the training described by ``config``; returns the process exit code.

    SIGTERM or SIGINT to this process (or to the ranks) stops the run after the current optimizer step with
    one checkpoint written there; the exit code is then 0 for SIGTERM and 130 for SIGINT. A rank that fails
    or dies ends every rank (exit code 1, the failing rank and its error printed).

    Raises:
        SeqparInputError: settings or files that cannot work (raised before any rank starts).
    """
    if _under_torchrun():
        return _launch_torchrun(config)
    world = config.nproc if config.nproc is not None else config.dims().world_size
    model_cfg = _precheck(config, world)
    run_dir = _prepare_run_dir(config)
    if config.resume == "auto" and latest_checkpoint(os.path.join(run_dir, "checkpoints")) is None:
        print(f"no complete checkpoint under {run_dir}/checkpoints; starting from step 0", flush=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        resolved = {"world_size": world, "launcher": "spawn (gloo, CPU)", "tokenizer_used": config.tokenizer_path()}
        json.dump({**config.to_dict(), **resolved}, f, indent=2)
    print(f"run directory: {run_dir}", flush=True)
    threads = max(1, (os.cpu_count() or 1) // world)
    timeout = timedelta(seconds=config.timeout_s)
    start = start_method_for("gloo")
    if start == "fork":  # imported once here instead of once per rank (Note [forked ranks])
        import seqpar.train.loop  # noqa: F401

        import_model_code(model_cfg)
    try:
        received = spawn_ranks(
            _rank_main,
            world,
            config,
            run_dir,
            timeout=timeout,
            threads=threads,
            forward_signals=True,
            start_method=start,
        )
    except mp.ProcessRaisedException as error:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        print(f"seqpar train failed on rank {error.error_index}: {lines[-1].strip()}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as error:
        print(f"seqpar train failed: rank {error.error_index} exited ({error})", file=sys.stderr)
        return 1
    if received is not None:
        return exit_code_for(received)
    print(f"done; run directory: {run_dir}", flush=True)
    return 0


def _launch_torchrun(config: TrainConfig) -> int:
    from seqpar.train.loop import train_rank

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # host-resident shards (--offload-optimizer): collectives on CPU tensors, e.g. in checkpointing, go to gloo
    backend = ("cuda:nccl,cpu:gloo" if config.offload_optimizer else "nccl") if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s))
    received = None
    try:
        _precheck(config, dist.get_world_size())
        run_dir = _prepare_run_dir(config) if dist.get_rank() == 0 else None
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)
        run_dir = shared[0]
        if dist.get_rank() == 0:
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                resolved = {
                    "world_size": dist.get_world_size(),
                    "launcher": "torchrun",
                    "tokenizer_used": config.tokenizer_path(),
                }
                json.dump({**config.to_dict(), **resolved}, f, indent=2)
            print(f"run directory: {run_dir}", flush=True)
        received = train_rank(config, run_dir)
        dist.barrier()
        if dist.get_rank() == 0 and received is None:
            print(f"done; run directory: {run_dir}", flush=True)
    except SeqparInputError as error:
        if dist.get_rank() == 0:
            print(f"seqpar train: {error}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    return exit_code_for(received)
