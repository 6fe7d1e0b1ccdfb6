"""``seqpar demo``: every attention strategy on spawned CPU ranks, checked against one device and timed.

seqpar demo --ranks 2 --seq 4096
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.runtime.spawn import spawn_ranks, start_method_for


def _demo_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    mesh = seqpar.make_mesh()
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    kv_shape = (1, args.kv_heads, args.seq, args.head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in (shape, kv_shape, kv_shape, shape))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    single_s = time.perf_counter() - start
    if rank == 0:
        print(
            f"{args.ranks} ranks, causal attention, seq {args.seq}, heads {args.heads}/{args.kv_heads}, "
            f"head_dim {args.head_dim}; one process took {single_s:.2f}s fwd+bwd"
        )
    for strategy in ("ring", "ulysses", "allgather"):
        try:
            local = [seqpar.shard_sequence(t.detach(), mesh, dim=2).requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            out = seqpar.attention(*local, mesh=mesh, strategy=strategy, causal=True)
            out.backward(seqpar.shard_sequence(dout, mesh, dim=2))
            seconds = time.perf_counter() - start
        except seqpar.SeqparInputError as error:
            if rank == 0:
                print(f"  {strategy:>9}: not applicable here ({error})")
            continue
        worst = max(
            float((got - seqpar.shard_sequence(want, mesh, dim=2)).abs().max())
            for got, want in zip((out.detach(), *(t.grad for t in local)), (ref.detach(), *(t.grad for t in full)))
        )
        worst_all = torch.tensor([worst, seconds])
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"  {strategy:>9}: max |difference| vs one device {worst_all[0]:.1e}, slowest rank {worst_all[1]:.2f}s"
            )


def run_demo(ranks: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Spawn gloo ranks and compare ring, ulysses and allgather attention with one-device SDPA.

    Args:
        ranks: sequence-parallel ranks to spawn (one thread each).
        seq: total sequence length.
        heads: query heads.
        kv_heads: key/value heads.
        head_dim: head dimension.

    Returns:
        0 (the exit code); the comparison and the times are printed by rank 0.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed.
    """
    args = argparse.Namespace(ranks=ranks, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    spawn_ranks(_demo_rank, ranks, args, timeout=timedelta(minutes=5), start_method=start_method_for("gloo"))
    return 0
