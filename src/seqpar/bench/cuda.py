"""GPU kernels inside seqpar's block plans: one zigzag ring rank's attention compute against the whole sequence.

    seqpar bench cuda [--seqs 16384 65536] [--ranks 1 2 4 8] [--heads 32 --kv-heads 8 --head-dim 128]

One GPU, one process: for each world size P it runs, with seqpar's kernels and block plans, every block a
zigzag ring rank computes over the P ring steps (forward, merge; backward with the final out/lse in the
ring's K/V pieces), with the transfers left out, and times it against one ``F.scaled_dot_product_attention``
call on the whole sequence (causal, bf16, forward + backward, CUDA events). The ideal share is 1/P; P=1 is
seqpar's kernel on the whole sequence (one block), which separates the kernel from the cost of splitting
into blocks and pieces and merging.
Every rank's output is checked against SDPA before timing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.kernels import select_kernel
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward
from seqpar.sequence_parallel.tiling.pieces import piece_ids, pieces_per_chunk, take_piece
from seqpar.sequence_parallel.tiling.planner import plan_blocks


def _time_ms(fn, repeats: int) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def _chunks(t: torch.Tensor, ids: tuple[int, ...], size: int) -> torch.Tensor:
    return torch.cat([t[:, :, i * size : (i + 1) * size] for i in ids], dim=2)


def _rank_step(q, k, v, dout, ranks: int, rank: int):
    """All of one zigzag rank's attention work over a full ring pass, as ``ring_attention`` splits it
    (whole K/V blocks forward, pieces backward: Note [ring backward]); returns (run, chunk ids, chunk, kernel)."""
    chunk = q.shape[2] // (2 * ranks)
    mine = (rank, 2 * ranks - 1 - rank)
    ql, dl = _chunks(q, mine, chunk), _chunks(dout, mine, chunk)
    held = [(s, 2 * ranks - 1 - s) for s in range(ranks)]  # what the ring brings, one rank's pair per step
    kv = [(ids, _chunks(k, ids, chunk), _chunks(v, ids, chunk)) for ids in held]
    kernel = select_kernel(ql, kv[0][1], kv[0][2])
    scale = q.shape[-1] ** -0.5
    split = pieces_per_chunk(chunk, q.device.type) if ranks > 1 else 1  # one rank runs local attention
    piece = chunk // split
    q_pieces = piece_ids(mine, split)

    def run():
        out, lse = new_accumulator(ql)
        for ids, kl, vl in kv:
            blocks_forward(kernel, ql, kl, vl, plan_blocks(mine, ids, chunk, True), scale, out, lse)
        final = out.to(q.dtype)
        dq = torch.zeros_like(ql, dtype=torch.float32)
        for j in range(split):
            for ids, kl, vl in kv:
                kp, vp = take_piece(kl, 2, split, j), take_piece(vl, 2, split, j)
                dk = torch.zeros_like(kp, dtype=torch.float32)
                dv = torch.zeros_like(vp, dtype=torch.float32)
                blocks = plan_blocks(q_pieces, [c * split + j for c in ids], piece, True)
                blocks_backward(kernel, dl, ql, kp, vp, final, lse, blocks, scale, dq, dk, dv, 2 * piece)
        return final, dq

    return run, mine, chunk, kernel.name


def main(argv: list[str] | None = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="seqpar bench cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("seqpar bench cuda needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, causal, forward + backward")
    print(f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, batch 1; times in ms (CUDA events)")
    print("| seq | P | kernel | SDPA whole | rank (max) | share | ideal 1/P | SDPA TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        gen = torch.Generator(device="cuda").manual_seed(seq)
        shape = (1, args.heads, seq, args.head_dim)
        kv_shape = (1, args.kv_heads, seq, args.head_dim)
        q, dout = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(kv_shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def whole(leaves=leaves, dout=dout):
            for t in leaves:
                t.grad = None
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(dout)
            return out

        want = whole().detach()
        want_dq = leaves[0].grad.clone()
        single = _time_ms(whole, args.repeats)
        flops = 3.5 * 2 * 2 * seq * seq * args.heads * args.head_dim / 2  # fwd 1x + bwd 2.5x, causal half
        for ranks in args.ranks:
            worst = 0.0
            for rank in range(ranks):
                run, mine, chunk, name = _rank_step(q, k, v, dout, ranks, rank)
                out, dq = run()
                for got, ref in ((out, want), (dq, want_dq)):
                    ref = _chunks(ref, mine, chunk).float()
                    err = float((got.float() - ref).norm() / ref.norm())
                    if err > 1e-2:
                        raise SystemExit(f"P={ranks} rank {rank}: relative error {err:.2e} against SDPA")
                if rank in (0, ranks - 1):  # the zigzag makes every rank's work the same; time the ends
                    worst = max(worst, _time_ms(run, args.repeats))
            print(
                f"| {seq} | {ranks} | {name} | {single:.1f} | {worst:.1f} | {worst / single:.3f} | "
                f"{1 / ranks:.3f} | {flops / single / 1e9:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
