"""``seqpar.context_parallel``: torch's context-parallel SDPA code with one import changed, against one process.

Real gloo ranks (NCCL for the CUDA variant). Every rank builds the full reference from the same seed and
compares: fp32 outputs, losses and gradients with rtol 1e-5 / atol 1e-6; bf16 by norm-wise error against
fp64, at most 1.5x that of single-device bf16 SDPA (fp16 likewise). Labels are shifted before sharding, so every rank's
labels are its own tokens' next tokens and every label is valid: each rank's mean loss over its S/P tokens
is then a 1/P share of the sequence's mean, and the average over ranks of the losses and of the parameter
gradients is the single-process loss and gradient (as data-parallel averaging over the CP ranks does).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.functional import scaled_dot_product_attention

import seqpar
from seqpar import context_parallel, context_parallel_unshard
from tests._dist import run_ranks, shard_index
from tests._sdpa_models import GPT, VideoBlock

FP32 = dict(rtol=1e-5, atol=1e-6)
RATIO = 1.5
SEQ = 24  # divides 2P for P = 2, 3, 4
# SDPA reached inside another torch call (checkpoint recomputation in backward, nn.MultiheadAttention) is
# served where torch can redispatch one hop with the mode kept on (torch >= 2.13)
REENTRY = hasattr(torch.overrides, "redispatch_function")


def _snippet(mesh, q, k, v, dout):
    # torch's snippet, verbatim but for the import; backward inside the block, as a training step does
    with context_parallel(mesh, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)
    return out


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _reference(full, dout, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in full]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _check_snippet(rank, world, mesh, device, seq, dtype):
    """The snippet on leaves that require grad; a second block (seqpar mesh, imported SDPA name) accumulates."""
    gen = torch.Generator().manual_seed(1)
    full = [torch.randn(2, 4, seq, 16, generator=gen).to(device) for _ in range(3)]
    dout = torch.randn(2, 4, seq, 16, generator=gen).to(device)
    local_dout = dout[:, :, shard_index("zigzag", world, rank, seq).to(device)].to(dtype)
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in full)
    out = _snippet(mesh, q, k, v, local_dout)
    assert q.shape == full[0].shape and torch.equal(q.detach(), full[0].to(dtype)), "q not restored"
    got = context_parallel_unshard(mesh, [out, q.grad, k.grad, v.grad], [2, 2, 2, 2])
    exact = _reference(full, dout, torch.float64)
    if dtype == torch.float32:
        for g, e in zip(got, exact):
            torch.testing.assert_close(g, e.float(), **FP32)
    else:
        single = _reference(full, dout, dtype)
        for name, g, s, e in zip(("out", "dq", "dk", "dv"), got, single, exact):
            assert _rel_err(g, e) <= RATIO * _rel_err(s, e), f"{dtype} {name}: {_rel_err(g, e)} vs {_rel_err(s, e)}"
    # successive block, another kind of mesh, SDPA under an imported name: .grad keeps the shard's shape
    second = seqpar.make_mesh(device_type=torch.device(device).type) if dtype == torch.float32 else dist.group.WORLD
    with context_parallel(second, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2), strategy="allgather"):
        scaled_dot_product_attention(q, k, v, is_causal=True).backward(local_dout)
    twice = context_parallel_unshard(mesh, [q.grad, k.grad, v.grad], [2, 2, 2])
    for g, first in zip(twice, got[1:]):
        tolerance = FP32 if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)  # low-precision .grad sums round
        torch.testing.assert_close(g, 2 * first, **tolerance)


def _avg(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world


def _check_gpt(rank, world, cases):
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, seq=SEQ)
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    loss_ref = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    runs = [(s, m, layout, False) for s, m in cases for layout in seqpar.LAYOUTS]
    if REENTRY:  # the first case again with activation checkpointing: the backward recomputes SDPA
        runs.append((*cases[0], "zigzag", True))
    for strategy, mesh, layout, checkpointing in runs:
        model.checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        ids, labels = tokens[:, :-1], tokens[:, 1:]  # views, shifted before sharding
        with context_parallel(
            mesh, buffers=(ids, labels, model.rope), buffer_seq_dims=(1, 1, 0), strategy=strategy, layout=layout
        ):
            loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            loss.backward()
        what = f"GPT P={world} {strategy} {layout}{' checkpointed' if checkpointing else ''}"
        assert model.rope.shape[0] == SEQ and ids.shape[1] == SEQ, f"{what}: buffers not restored"
        torch.testing.assert_close(_avg(loss, world), loss_ref.detach(), **FP32, msg=f"{what}: loss")
        for n, p in model.named_parameters():
            torch.testing.assert_close(_avg(p.grad, world), grads_ref[n], **FP32, msg=f"{what}: {n}")


def _check_video(rank, world, mesh, strategies):
    torch.manual_seed(0)
    block = VideoBlock(channels=8, dim=48, heads=6, tokens=SEQ)  # 4 frames x 6 patches
    gen = torch.Generator().manual_seed(3)
    latents, target, t = torch.randn(2, SEQ, 8, generator=gen), torch.randn(2, SEQ, 8, generator=gen), torch.rand(2)
    ref_in = latents.clone().requires_grad_()
    out_ref = block(ref_in, t)
    F.mse_loss(out_ref, target).backward()
    grads_ref = {n: p.grad.clone() for n, p in block.named_parameters()}
    for strategy in strategies:
        for layout in seqpar.LAYOUTS:
            block.zero_grad(set_to_none=True)
            x, y = latents.clone().requires_grad_(), target.clone()
            with context_parallel(
                mesh, buffers=(x, y, block.pos), buffer_seq_dims=(1, 1, 0), strategy=strategy, layout=layout
            ):
                out = block(x, t)
                F.mse_loss(out, y).backward()
            what = f"video P={world} {strategy} {layout}"
            full_out, full_grad = context_parallel_unshard(mesh, [out.detach(), x.grad], [1, 1], layout=layout)
            torch.testing.assert_close(full_out, out_ref.detach(), **FP32, msg=f"{what}: output")
            # each rank's mean is over S/P tokens: the ranks' losses add up to P x the sequence's mean
            torch.testing.assert_close(full_grad / world, ref_in.grad, **FP32, msg=f"{what}: input grad")
            for n, p in block.named_parameters():
                torch.testing.assert_close(_avg(p.grad, world), grads_ref[n], **FP32, msg=f"{what}: {n}")


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    _check_snippet(rank, world, mesh, "cpu", 48, torch.float32)
    if world == 2:
        for dtype in (torch.bfloat16, torch.float16):
            _check_snippet(rank, world, mesh, "cpu", 256, dtype)
    ulysses = ["ulysses"] if 4 % world == 0 else []  # GPT: 4 query heads, 2 KV heads
    cases = [(s, mesh) for s in ("ring", *ulysses, "allgather")]
    if world == 4:
        cases.append(("hybrid", seqpar.make_mesh(ulysses_size=2)))
    _check_gpt(rank, world, cases)
    if world < 4:
        _check_video(rank, world, mesh, ("ring", "ulysses", "allgather", "auto"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_matches_one_process(world):
    run_ranks(world, _worker)


def _cuda_worker(rank, world):
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (world,))
    for dtype in (torch.float32, torch.bfloat16):
        _check_snippet(rank, world, mesh, "cuda", 256, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_context_parallel_cuda():
    run_ranks(torch.cuda.device_count(), _cuda_worker, backend="nccl")


def _attend(q, k, v):
    """Plain softmax attention, for checking that no mode is left behind after a block."""
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


def _raises_everywhere(match: str, fn) -> None:
    """``fn`` must raise ``SeqparInputError`` on this rank; every rank calls this, so it holds on every rank."""
    with pytest.raises(seqpar.SeqparInputError, match=match):
        fn()


def _enter(mesh, **kwargs) -> None:
    with context_parallel(mesh, **kwargs):
        pass


def _sdpa_in_block(mesh, buffers, **sdpa_kwargs) -> None:
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
        F.scaled_dot_product_attention(*buffers[:3], **sdpa_kwargs)


def _bad_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 8, 8, generator=gen) for _ in range(3))
    kv2 = torch.randn(1, 2, 8, 8, generator=gen)
    ids, rope, one = torch.arange(8)[None], torch.randn(16, 4), torch.ones(8, 8, dtype=torch.bool)
    mask = dict(attn_mask=one) if rank == 1 else {}
    param = torch.nn.Parameter(torch.randn(1, 8))
    cases = [
        ("attn_mask is not supported.*is_causal=True.*position_ids", lambda: _sdpa_in_block(mesh, [q, k, v], **mask)),
        ("dropout_p", lambda: _sdpa_in_block(mesh, [q, k, v], dropout_p=0.1)),
        ("enable_gqa=True", lambda: _sdpa_in_block(mesh, [q, kv2, kv2.clone()])),
        ("different sequence lengths", lambda: _enter(mesh, buffers=[ids, rope], buffer_seq_dims=[1, 0])),
        ("ranks disagree", lambda: _enter(mesh, buffers=[torch.arange(8 + 4 * rank)[None]], buffer_seq_dims=[1])),
        ("does not divide into the zigzag layout", lambda: _enter(mesh, buffers=[ids[:, :6]], buffer_seq_dims=[1])),
        ("nn.Parameter", lambda: _enter(mesh, buffers=[param if rank == 0 else ids], buffer_seq_dims=[1])),
        ("not a subset", lambda: _enter(mesh, buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={rope})),
        ("not a leaf", lambda: _enter(mesh, buffers=[param * 2], buffer_seq_dims=[1])),
        ("different lengths", lambda: _enter(mesh, buffers=[ids, q], buffer_seq_dims=[1])),
        ("2 dimensions", lambda: _enter(init_device_mesh("cpu", (1, world)), buffers=[ids], buffer_seq_dims=[1])),
        ("mesh must be", lambda: _enter(None, buffers=[ids], buffer_seq_dims=[1])),
        (
            "unknown strategy|strategy='ringo'",
            lambda: _enter(mesh, buffers=[ids], buffer_seq_dims=[1], strategy="ringo"),
        ),
    ]
    for match, fn in cases:
        _raises_everywhere(match, fn)
        assert q.shape[2] == ids.shape[1] == 8 and k.shape[2] == 8, f"{match}: a buffer was left sharded"
    # the message names the rank that was wrong, on the ranks that were right too
    _raises_everywhere("rank 1.*attn_mask", lambda: _sdpa_in_block(mesh, [q, k, v], **mask))
    with pytest.raises(ZeroDivisionError), context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        _ = 1 / 0
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), _attend(q, k, v), **FP32)
    _check_nesting_and_grads(rank, world, mesh, q, k, v)


def _check_nesting_and_grads(rank, world, mesh, q, k, v):
    """Nested blocks on another mesh, a full .grad at entry, and a buffer left sharded by no_restore_buffers."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    local = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], layout="contiguous"):
        with context_parallel(singles[rank], buffers=local, buffer_seq_dims=[2, 2, 2]):
            inner = F.scaled_dot_product_attention(*local)  # this rank alone: the whole sequence
        outer = F.scaled_dot_product_attention(q, k, v)  # back on the outer mesh
    torch.testing.assert_close(inner, F.scaled_dot_product_attention(q, k, v), **FP32)
    rows = shard_index("contiguous", world, rank, 8)
    torch.testing.assert_close(outer, _attend(q, k, v)[:, :, rows], **FP32)
    x = torch.randn(1, 8, 3, requires_grad=True)
    x.grad = torch.arange(24.0).view(1, 8, 3)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], no_restore_buffers={x}):
        assert x.grad.shape == (1, 4, 3)  # sharded along with its tensor (Note [grad-requiring buffers])
        (2 * x).sum().backward()
    assert x.shape == (1, 4, 3), "a no_restore buffer stays sharded"
    full = context_parallel_unshard(mesh, [x.grad], [1])[0]
    torch.testing.assert_close(full, torch.arange(24.0).view(1, 8, 3) + 2, **FP32)
    if REENTRY:  # nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward
        torch.manual_seed(0)
        mha, x = torch.nn.MultiheadAttention(16, 4, batch_first=True), torch.randn(2, 8, 16)
        want = mha(x, x, x, need_weights=False)[0].detach()
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            got = mha(x, x, x, need_weights=False)[0].detach()
        torch.testing.assert_close(context_parallel_unshard(mesh, [got], [1])[0], want, **FP32)


def test_bad_input_raises_on_every_rank_and_leaves_nothing_behind():
    run_ranks(2, _bad_worker)
