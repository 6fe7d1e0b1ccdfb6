"""``seqpar plan``: the flags, reading lengths like 1M, and printing or saving a plan or a calibration.

The ``seqpar`` command line adds these flags to its ``plan`` subcommand and calls ``run_plan``.
"""

from __future__ import annotations

import argparse
import re
import sys

from seqpar.errors import SeqparInputError
from seqpar.planning.calibrate import calibrate
from seqpar.planning.cluster import Cluster, load_calibration, save_calibration
from seqpar.planning.models import PRESETS
from seqpar.planning.report import format_plan, write_json
from seqpar.planning.search import DP_MODES, plan

__all__ = ["add_plan_flags", "parse_tokens", "run_plan"]

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
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--gpu-tflops", type=float, default=989.0, help="dense peak at the dtype (H100 bf16: 989)")
    parser.add_argument("--intra-node-gbps", type=float, default=900.0, help="GB/s per device, both ways (NVLink)")
    parser.add_argument("--inter-node-gbps", type=float, default=400.0, help="Gbit/s per device (NIC line rate)")
    parser.add_argument("--matmul-efficiency", type=float, default=0.6)
    parser.add_argument("--attention-efficiency", type=float, default=0.45)
    parser.add_argument("--link-efficiency", type=float, default=0.75)
    parser.add_argument("--memory-headroom", type=float, default=0.9, help="fraction of device memory to fill")
    parser.add_argument("--ulysses-across-nodes", action="store_true", help="allow all-to-all and tp across nodes")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--dp-mode", nargs="+", default=list(DP_MODES), choices=("fsdp", "replicate", "ddp"))
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--rejected", type=int, default=15, help="rejected families listed (0: all of them)")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    parser.add_argument("--calibration", metavar="FILE", help="rates measured by --calibrate (replace the above)")
    parser.add_argument(
        "--calibrate", metavar="FILE", help="measure this machine's rates (2 CPU ranks, ~30 s) into FILE, then exit"
    )


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = Cluster(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gb=args.gpu_memory_gb,
        gpu_tflops=args.gpu_tflops,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        matmul_efficiency=args.matmul_efficiency,
        attention_efficiency=args.attention_efficiency,
        link_efficiency=args.link_efficiency,
        memory_headroom=args.memory_headroom,
        ulysses_across_nodes=args.ulysses_across_nodes,
    )
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
        )
    except SeqparInputError as error:
        print(f"seqpar plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(result, args.top, args.rejected or len(result.rejected)))
    if args.json:
        write_json(result, args.json, args.top)
    return 0
