"""Bad input raises the same clear SeqparInputError on every rank, before anything can hang (gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from tests._dist import run_ranks


def _qkv(heads=4, kv_heads=4, seq=8, dim=16, dtype=torch.float32):
    return (
        torch.randn(1, heads, seq, dim, dtype=dtype),
        torch.randn(1, kv_heads, seq, dim, dtype=dtype),
        torch.randn(1, kv_heads, seq, dim, dtype=dtype),
    )


def _cases(rank):
    """(description, kwargs builder, expected message fragment); some are bad on one rank only."""
    return [
        ("zigzag needs 2P chunks", lambda: dict(zip("qkv", _qkv(seq=7))), "multiple of 4 (2P for zigzag)"),
        (
            "heads vs ulysses degree",
            lambda: {**dict(zip("qkv", _qkv(heads=1, kv_heads=1))), "strategy": "ulysses"},
            "ulysses over 2 ranks needs at least 2 query heads (one per rank); the model has 1",
        ),
        (
            "kv heads vs query heads",
            lambda: dict(zip("qkv", _qkv(heads=4, kv_heads=3))),
            "key/value heads (3) must divide query heads (4)",
        ),
        ("unknown strategy", lambda: {**dict(zip("qkv", _qkv())), "strategy": "rign"}, "unknown strategy"),
        ("unknown layout", lambda: {**dict(zip("qkv", _qkv())), "layout": "striped"}, "unknown layout"),
        (
            "unsupported dtype",
            lambda: dict(zip("qkv", _qkv(dtype=torch.float64))),
            "dtype torch.float64; supported: float32, bfloat16, float16",
        ),
        (
            "different devices",
            lambda: {
                "q": _qkv()[0],
                "k": torch.empty(1, 4, 8, 16, device="meta"),
                "v": torch.empty(1, 4, 8, 16, device="meta"),
            },
            "different devices",
        ),
        (
            "shapes differ across ranks",
            lambda: dict(zip("qkv", _qkv(seq=8 + 4 * rank))),
            "inputs differ across ranks",
        ),
        (
            "strategy differs across ranks",
            lambda: {**dict(zip("qkv", _qkv())), "strategy": "ring" if rank else "allgather"},
            "inputs differ across ranks",
        ),
        (
            "one rank's dtype is bad",
            lambda: dict(zip("qkv", _qkv(dtype=torch.float64 if rank else torch.float32))),
            "rank 1: q has dtype torch.float64",
        ),
        (
            "one rank passes an unknown layout",
            lambda: {**dict(zip("qkv", _qkv())), "layout": "zigzag" if rank == 0 else "zz"},
            "rank 1: unknown layout",
        ),
        (
            "3-D input",
            lambda: {"q": torch.randn(4, 8, 16), "k": torch.randn(4, 8, 16), "v": torch.randn(4, 8, 16)},
            "must be 4-D",
        ),
        ("head_dim too large", lambda: dict(zip("qkv", _qkv(dim=320))), "head_dim 320 is outside 1..256"),
        (
            "one rank's chunk is not a size",
            lambda: {**dict(zip("qkv", _qkv())), "chunk": 0 if rank else 4},
            "rank 1: chunk must be a positive integer",
        ),
    ]


CASE_NAMES = [name for name, _, _ in _cases(0)]


def _bad_input_worker(rank, world_size, index):
    mesh = seqpar.make_mesh()
    name, build, fragment = _cases(rank)[index]
    kwargs = build()
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    with pytest.raises(SeqparInputError) as info:
        seqpar.attention(q, k, v, mesh=mesh, **kwargs)
    assert fragment in str(info.value), f"{name}: {info.value}"
    # the group is still in step: a valid call right after works on every rank
    out = seqpar.attention(*_qkv(), mesh=mesh, strategy="ring")
    assert out.shape == (1, 4, 8, 16)


@pytest.mark.parametrize("index", range(len(CASE_NAMES)), ids=[n.replace(" ", "-") for n in CASE_NAMES])
def test_bad_input_raises_everywhere(index):
    run_ranks(2, _bad_input_worker, index)


def _ulysses_few_heads_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    with pytest.raises(SeqparInputError, match=r"ulysses over 3 ranks needs at least 3 query heads.*has 2"):
        seqpar.attention(*_qkv(heads=2, kv_heads=1, seq=12), mesh=mesh, strategy="ulysses")
    seqpar.attention(*_qkv(heads=2, kv_heads=1, seq=12), mesh=mesh, strategy="ring")


def test_ulysses_refuses_fewer_heads_than_ranks():
    run_ranks(3, _ulysses_few_heads_worker)


def test_single_process_checks_without_a_group():
    with pytest.raises(SeqparInputError, match="k \\(1, 4, 8, 16\\) and v \\(1, 4, 9, 16\\) must agree in batch"):
        seqpar.attention(torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16), torch.randn(1, 4, 9, 16))
    with pytest.raises(SeqparInputError, match="scale must be a positive finite number"):
        seqpar.attention(*_qkv(), scale=float("nan"))
