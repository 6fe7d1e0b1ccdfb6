"""``seqpar plan``: the flags, reading lengths like 1M, and printing or saving a plan or a calibration.

The ``seqpar`` command line adds these flags to its ``plan`` subcommand and calls ``run_plan``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields

from seqpar.errors import SeqparInputError
from seqpar.memory.dtypes import DTYPES
from seqpar.planning.cluster import Cluster, load_calibration, save_calibration
from seqpar.planning.models import PRESETS
from seqpar.planning.report import format_plan, write_json
from seqpar.planning.search import DP_MODES, plan

_SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_tokens(text: str) -> int:
    """A token count such as 131072, 128K, 1M or 1.5M (K = 1024, M = 1024^2).

    Args:
        text: the count.

    Returns:
        The count as an integer.

    Raises:
        SeqparInputError: not a positive count.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", str(text))
    if not match or float(match[1]) * _SUFFIX[match[2].lower()] < 1:
        raise SeqparInputError(f"not a positive token count: {text!r} (use e.g. 131072, 128K or 1M)")
    return round(float(match[1]) * _SUFFIX[match[2].lower()])


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``seqpar plan``'s flags to ``parser``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--model", help=f"config.json, a model directory, or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--seq-len", default="128K", help="tokens per sequence: 131072, 128K, 1M (K=1024)")
    parser.add_argument("--gpus", type=int, default=8, help="devices in all")
    parser.add_argument("--gpus-per-node", type=int, default=Cluster.gpus_per_node)
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=Cluster.gpu_memory_gb,
        help="memory of one device as labelled, read as GiB (2^30 bytes): 80 for an '80 GB' H100, which CUDA "
        "shows as 81,559 MiB; --memory-headroom of it is planned with (default: %(default)g)",
    )
    parser.add_argument(
        "--gpu-tflops", type=float, default=Cluster.gpu_tflops, help="dense peak at the dtype (H100 bf16: 989)"
    )
    parser.add_argument(
        "--intra-node-gbps", type=float, default=Cluster.intra_node_gbps, help="GB/s per device, both ways (NVLink)"
    )
    parser.add_argument(
        "--inter-node-gbps", type=float, default=Cluster.inter_node_gbps, help="Gbit/s per device (NIC line rate)"
    )
    parser.add_argument("--matmul-efficiency", type=float, default=Cluster.matmul_efficiency)
    parser.add_argument("--attention-efficiency", type=float, default=Cluster.attention_efficiency)
    parser.add_argument("--link-efficiency", type=float, default=Cluster.link_efficiency)
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=Cluster.memory_headroom,
        help="fraction of --gpu-memory-gb to fill; the rest: CUDA context, kernels, fragmentation "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--host-link-gbps",
        type=float,
        default=Cluster.host_link_gbps,
        help="device <-> host GB/s each way, for optimizer offload (PCIe Gen5 x16: ~50 effective; "
        "default: %(default)g)",
    )
    parser.add_argument(
        "--host-adam-gparams-per-s",
        type=float,
        default=Cluster.host_adam_gparams_per_s,
        help="billions of parameters/s one node's CPUs update with AdamW under optimizer offload "
        "(default: %(default)g)",
    )
    parser.add_argument("--ulysses-across-nodes", action="store_true", help="allow all-to-all and tp across nodes")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument(
        "--pp-microbatches",
        type=int,
        default=8,
        help="micro-batches (of --micro-batch sequences) per step of the pipeline-parallel layouts (1F1B); "
        "pp degrees up to it are tried",
    )
    parser.add_argument(
        "--doc-len",
        help="rows packed with documents of about this many tokens (2K, 1500), sharded with the placed layout: "
        "attention work and ring / all-gather K/V shrink, ulysses' all-to-all does not (Note [planned documents])",
    )
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--dp-mode", nargs="+", default=list(DP_MODES), choices=("fsdp", "replicate", "ddp"))
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--rejected", type=int, default=15, help="rejected families listed (0: all of them)")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    parser.add_argument("--calibration", metavar="FILE", help="rates measured by --calibrate (replace the above)")
    parser.add_argument(
        "--calibrate", metavar="FILE", help="measure this machine's rates (2 CPU ranks, ~30 s) into FILE, then exit"
    )


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = Cluster(**{f.name: getattr(args, f.name) for f in fields(Cluster)})
    return cluster.with_calibration(load_calibration(args.calibration)) if args.calibration else cluster


def run_plan(args: argparse.Namespace) -> int:
    """Run ``seqpar plan`` with parsed flags: calibrate, or plan and print (and save) the result.

    Args:
        args: from a parser built by ``add_plan_flags``.

    Returns:
        The exit status: 0, or 2 on bad input (the message on stderr).
    """
    try:
        if args.calibrate:
            from seqpar.planning.calibrate import calibrate  # spawns torch ranks: only this flag loads torch

            calibration = calibrate()
            save_calibration(calibration, args.calibrate)
            print(f"wrote {args.calibrate}: {calibration}")
            return 0
        if not args.model:
            raise SeqparInputError("--model is required (a config.json, a model directory or a preset)")
        result = plan(
            args.model,
            parse_tokens(args.seq_len),
            _cluster(args),
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            dp_modes=tuple(args.dp_mode),
            pp_microbatches=args.pp_microbatches,
            doc_len=parse_tokens(args.doc_len) if args.doc_len else None,
        )
    except SeqparInputError as error:
        print(f"seqpar plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(result, args.top, args.rejected or len(result.rejected)))
    if args.json:
        write_json(result, args.json, args.top)
    return 0
