"""Bytes each rank writes to its sockets in one step equal each strategy's analytical volume (within 1%).

Read from /proc/self/io (the kernel's count), so an extra or larger transfer anywhere fails this test.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.bench.strategies import _written_bytes, expected_bytes
from tests._dist import run_ranks

CFG = {"ranks": 4, "ulysses": 2, "seq": 2048, "heads": 8, "kv_heads": 2, "head_dim": 64}


def _bytes_worker(rank, world_size):
    meshes = {"flat": seqpar.make_mesh(), "two_d": seqpar.make_mesh(ulysses_size=CFG["ulysses"])}
    s = CFG["seq"] // world_size
    for kv_heads in (2, 8):
        cfg = {**CFG, "kv_heads": kv_heads}
        q = torch.randn(1, cfg["heads"], s, cfg["head_dim"], requires_grad=True)
        k, v = (torch.randn(1, kv_heads, s, cfg["head_dim"], requires_grad=True) for _ in "kv")
        for strategy in ("ring", "ulysses", "hybrid", "allgather"):
            mesh = meshes["two_d" if strategy == "hybrid" else "flat"]
            dist.barrier()
            before = _written_bytes()
            seqpar.attention(q, k, v, mesh=mesh, strategy=strategy).sum().backward()
            sent = _written_bytes() - before
            want = expected_bytes(strategy, cfg)
            assert abs(sent / want - 1) < 0.01, f"{strategy} kv_heads={kv_heads}: sent {sent} bytes, expected {want}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
def test_bytes_sent_match_analytical_volume():
    run_ranks(4, _bytes_worker)
