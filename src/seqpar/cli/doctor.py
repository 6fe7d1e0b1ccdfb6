"""``seqpar doctor``: does a sequence-parallel step of this model differ from one process, and why (``seqpar.doctor``).

seqpar doctor                                   # seqpar train's demo model, 2 spawned CPU ranks, a generated batch
seqpar doctor --model ./my-llama --sp 4 --strategy ring --data a.jsonl --seq-len 4096   # or under torchrun
seqpar doctor --model ./my-qwen2.5-vl --seq-len 512     # a vision-language model: generated rows with images
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.cli.arguments import (
    add_default_model_arguments,
    add_degree_arguments,
    add_dtype_argument,
    add_model_argument,
    model_settings,
)
from seqpar.data import pack_documents
from seqpar.diagnosis import doctor
from seqpar.diagnosis.multimodal import generated_multimodal_batch, is_multimodal
from seqpar.errors import SeqparInputError
from seqpar.memory.dtypes import DTYPES
from seqpar.mesh import make_mesh
from seqpar.runtime.spawn import spawn_ranks, start_method_for
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS
from seqpar.sequence_parallel.strategies.registry import STRATEGIES
from seqpar.train.config import TrainConfig
from seqpar.train.data import FileRows, load_tokenizer
from seqpar.train.model import build_model, model_config


def add_doctor_flags(p: argparse.ArgumentParser) -> None:
    """Add ``seqpar doctor``'s flags to its subcommand's parser.

    Args:
        p: the ``doctor`` parser of the ``seqpar`` command line.
    """
    add_model_argument(p, presets=False)
    add_degree_arguments(p, sp_default=2, sp_help="sequence-parallel ranks (spawned on CPU unless under torchrun)")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto", help="attention strategy")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout")
    add_dtype_argument(p)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--batch-size", type=int, default=2, help="rows in the batch")
    p.add_argument(
        "--data", nargs="*", default=[], help="local .txt/.jsonl/.json/.parquet files, packed as seqpar train does"
    )
    p.add_argument("--text-field", default="text", help="column holding the text in --data files")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for --data (default as seqpar train)")
    p.add_argument("--tolerance", type=float, default=None, help="relative tolerance (default: by dtype)")
    p.add_argument("--seed", type=int, default=0, help="weights and generated batch")
    add_default_model_arguments(p)


def _settings(args: argparse.Namespace) -> TrainConfig:
    return model_settings(
        args, data=list(args.data), text_field=args.text_field, tokenizer=args.tokenizer, seed=args.seed
    )


def _batch(args: argparse.Namespace, tokenizer: object, vocab: int, cache_dir: str) -> dict[str, torch.Tensor]:
    """The --data rows seqpar train would pack, or generated rows of packed documents of random tokens."""
    if args.data:
        rows = FileRows(args.data, tokenizer, args.seq_len, args.text_field, args.seed, cache_dir)
        return rows.batch(list(range(args.batch_size)))
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(2, args.seq_len // 4), args.seq_len + 1, (4 * args.batch_size,), generator=gen)
    docs = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    rows = pack_documents(docs, args.seq_len)[: args.batch_size]
    return {key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "position_ids")}


def _multimodal_config(settings: TrainConfig) -> object | None:
    """The model's config when it is a vision-language model (its batches are generated with images), else None."""
    if settings.model is None:
        return None
    config = model_config(settings, 0)
    return config if is_multimodal(config) else None


def _multimodal_batch(args: argparse.Namespace, config: object) -> dict[str, torch.Tensor]:
    """Generated whole rows with images for a vision-language model; --data (text rows) is refused for one."""
    if args.data:
        raise SeqparInputError(
            "--data holds text rows, but this is a vision-language model: seqpar doctor generates rows with images "
            "for it (drop --data), or call seqpar.doctor(model, mesh, batch) with your collator's batch"
        )
    return generated_multimodal_batch(config, args.seq_len, args.batch_size, args.seed)


def _tokenizer(settings: TrainConfig) -> tuple[object, int]:
    tokenizer = load_tokenizer(settings.tokenizer_path())
    return tokenizer, getattr(tokenizer, "vocab_size", None) or len(tokenizer)


def _doctor_rank(rank: int, world_size: int, args: argparse.Namespace, workdir: str) -> None:
    """One rank: model and batch built as ``seqpar train`` builds them, the doctor; rank 0 prints the report."""
    settings = _settings(args)
    multimodal = _multimodal_config(settings)
    if multimodal is not None:
        model, batch, eos = build_model(settings, 0, multimodal=True), _multimodal_batch(args, multimodal), None
    else:
        tokenizer, vocab = _tokenizer(settings)
        model = build_model(settings, vocab)
        batch = _batch(args, tokenizer, vocab, workdir)
        eos = getattr(tokenizer, "eos_token_id", None) if args.data else None
    model = model.to(DTYPES[args.dtype])
    if dist.get_backend() == "nccl":
        model = model.cuda()
    mesh = make_mesh(args.sp, ulysses_size=args.ulysses)
    report = doctor(
        model, mesh, batch, strategy=args.strategy, layout=args.layout, tolerance=args.tolerance, eos_token_id=eos
    )
    if rank == 0:
        print(report.table(), flush=True)
        with open(os.path.join(workdir, "verdict"), "w") as f:
            f.write("0" if report.verdict else "1")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _run_torchrun(args: argparse.Namespace) -> int:
    """The doctor on the ranks torchrun started; rank 0's temporary directory holds the packed --data rows."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)  # one machine: every rank reads rank 0's directory
            _doctor_rank(dist.get_rank(), dist.get_world_size(), args, shared[0])
            verdict = [None]
            if dist.get_rank() == 0:
                with open(os.path.join(tmp, "verdict")) as f:
                    verdict = [f.read()]
            dist.broadcast_object_list(verdict, src=0)
    finally:
        dist.destroy_process_group()
    return int(verdict[0])


def run_doctor(args: argparse.Namespace) -> int:
    """Run ``seqpar doctor`` for the parsed flags; returns the exit code (0 agree, 1 differ or pitfalls, 2 failed).

    Spawns ``--sp`` gloo CPU ranks, or uses the ranks torchrun started (NCCL on GPUs).

    Raises:
        SeqparInputError: an unreadable model config or tokenizer, or a vision-language model whose rows seqpar
            cannot generate (before any rank starts).
    """
    settings = _settings(args)
    multimodal = _multimodal_config(settings)
    if multimodal is not None:
        _multimodal_batch(args, multimodal)  # a family it cannot lay out, or too short rows: before any rank starts
    else:
        model_config(settings, _tokenizer(settings)[1])
    if _under_torchrun():
        return _run_torchrun(args)
    threads = max(1, (os.cpu_count() or 1) // args.sp)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spawn_ranks(
                _doctor_rank,
                args.sp,
                args,
                tmp,
                threads=threads,
                timeout=timedelta(minutes=10),
                start_method=start_method_for("gloo"),
            )
        except mp.ProcessRaisedException as error:
            lines = [line for line in str(error).strip().splitlines() if line.strip()]
            print(f"seqpar doctor failed on rank {error.error_index}: {lines[-1].strip()}", file=sys.stderr)
            return 2
        with open(os.path.join(tmp, "verdict")) as f:
            return int(f.read())
