"""CUDA kernels and NCCL strategies: the CPU suite's exactness checks, run where a GPU is present.

Skipped without CUDA. One GPU runs the kernels and every strategy on a one-rank NCCL group (whose zigzag
blocks still split and merge); N GPUs run the strategies on min(N, 4) ranks.

Accuracy is stated as a norm-wise relative error against an fp64 reference: at most 1.5x the error of one
whole-sequence SDPA call in the same dtype (plus 1e-6 so that two fp32 errors near rounding level compare
sensibly), and never above 2e-4 (fp32) or 2e-2 (bf16). A wrong merge or log-sum-exp gives errors near 1.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.sequence_parallel.kernels import (
    TorchCUDAEfficientKernel,
    TorchCUDAFlashKernel,
    TorchCuDNNKernel,
    select_kernel,
)
from seqpar.sequence_parallel.kernels.merge import merge_into, new_accumulator
from tests._dist import run_ranks, shard_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RATIO = 1.5
CAP = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
CUDNN, FLASH, EFFICIENT = TorchCuDNNKernel(), TorchCUDAFlashKernel(), TorchCUDAEfficientKernel()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def check_accuracy(what: str, got, baseline, exact, dtype: torch.dtype) -> None:
    """``got`` and ``baseline`` (same-dtype single SDPA) are tuples of tensors compared to fp64 ``exact``."""
    for name, g, b, e in zip(("out", "dq", "dk", "dv"), got, baseline, exact, strict=True):
        err, base = rel_err(g, e), rel_err(b, e)
        assert err <= min(RATIO * base + 1e-6, CAP[dtype]), f"{what} {name}: error {err:.2e}, SDPA {base:.2e}"


def sdpa_grads(q, k, v, dout, causal, mask=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def random_case(seed: int, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((heads, seq), (kv_heads, seq), (kv_heads, seq), (heads, seq))
    return [torch.randn(batch, h, s, head_dim, generator=gen, device=device, dtype=torch.float64) for h, s in shapes]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("kernel", [CUDNN, FLASH, EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_cuda_kernel_blocks_merge_exactly(kernel, causal, heads, head_dim):
    """The ring contract: key blocks run apart, merge by lse, and backwards fed the final out/lse add up."""
    if kernel is CUDNN and (not _hopper() or head_dim > 128):
        pytest.skip("cuDNN attention is used on Hopper and newer, head_dim up to 128")
    seq = 512
    half = slice(0, seq // 2), slice(seq // 2, seq)
    q, k, v, dout = random_case(zlib.crc32(repr((causal, heads, head_dim)).encode()), 2, *heads, seq, head_dim)
    exact = sdpa_grads(q, k, v, dout, causal)
    dtypes = (torch.float32, torch.bfloat16) if kernel is EFFICIENT else (torch.bfloat16,)
    for dtype in dtypes:
        ql, kl, vl, dl = (t.to(dtype) for t in (q, k, v, dout))
        # (query rows, key rows, causal square?) covering the attention matrix once
        if causal:
            blocks = [(half[0], half[0], True), (half[1], half[0], False), (half[1], half[1], True)]
        else:
            blocks = [(slice(0, seq), half[0], False), (slice(0, seq), half[1], False)]
        out, lse = new_accumulator(ql)
        for rows, cols, square in blocks:
            o, l = kernel.forward(ql[:, :, rows], kl[:, :, cols], vl[:, :, cols], causal=square, scale=head_dim**-0.5)
            merge_into(out[:, :, rows], lse[:, :, rows], o, l)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (ql, kl, vl))
        for rows, cols, square in blocks:
            grads = kernel.backward(
                dl[:, :, rows],
                ql[:, :, rows],
                kl[:, :, cols],
                vl[:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal=square,
                scale=head_dim**-0.5,
            )
            for acc, g, idx in zip((dq, dk, dv), grads, (rows, cols, cols), strict=True):
                acc[:, :, idx] += g
        baseline = sdpa_grads(ql, kl, vl, dl, causal)
        what = f"{kernel.name} {dtype} causal={causal} H={heads} D={head_dim}"
        check_accuracy(what, (out, dq, dk, dv), baseline, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_efficient_kernel_takes_any_mask_and_empty_rows(dtype):
    q, k, v, dout = random_case(3, 1, 4, 2, 100, 64)
    mask = torch.rand(1, 1, 100, 100, device="cuda", generator=torch.Generator("cuda").manual_seed(4)) > 0.7
    mask[:, :, 5] = False  # a row that sees no key: out 0, lse -inf, no gradient
    ql, kl, vl, dl = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = EFFICIENT.forward(ql, kl, vl, causal=False, scale=0.125, mask=mask)
    assert torch.isneginf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()
    grads = EFFICIENT.backward(dl, ql, kl, vl, out, lse, causal=False, scale=0.125, mask=mask)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, :, 5] == 0).all()
    # SDPA's own answer for an empty row varies by backend; the reference lets row 5 see every key but gives
    # it no output gradient, so it adds nothing to dk/dv and its dq is 0, as it must be here
    open_mask = mask.clone()
    open_mask[:, :, 5] = True
    quiet = dout.clone()
    quiet[:, :, 5] = 0
    exact = list(sdpa_grads(q, k, v, quiet, False, open_mask))
    baseline = list(sdpa_grads(ql, kl, vl, quiet.to(dtype), False, open_mask))
    exact[0][:, :, 5] = 0
    baseline[0][:, :, 5] = 0
    check_accuracy(f"efficient masked {dtype}", (out, *grads), baseline, exact, dtype)


def test_cuda_kernel_choice():
    x = torch.randn(1, 2, 8, 64, device="cuda")
    half = "torch_cudnn" if _hopper() else "torch_cuda_flash"
    assert select_kernel(x.bfloat16(), x.bfloat16(), x.bfloat16()).name == half
    assert select_kernel(*(torch.randn(1, 2, 8, 256, device="cuda").bfloat16(),) * 3).name == "torch_cuda_flash"
    assert select_kernel(x, x, x).name == "torch_cuda_efficient"
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool, device="cuda")
    assert select_kernel(x.bfloat16(), x.bfloat16(), x.bfloat16(), mask=mask).name == "torch_cuda_efficient"
    assert select_kernel(x.double(), x.double(), x.double()).name == "reference"


def _strategies_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    seq = 256 * world_size
    strategies = ["ring", "allgather", "ulysses"] + (["hybrid"] if world_size == 4 else [])
    for strategy in strategies:
        run_mesh = seqpar.make_mesh(ulysses_size=2) if strategy == "hybrid" else mesh
        for dtype in (torch.float32, torch.bfloat16):
            for layout, causal in (("zigzag", True), ("contiguous", False), ("contiguous", True)):
                for heads, kv_heads, head_dim in ((8, 8, 128), (8, 2, 64)):
                    seed = zlib.crc32(repr((strategy, layout, causal, heads, kv_heads)).encode())
                    q, k, v, dout = random_case(seed, 2, heads, kv_heads, seq, head_dim)
                    exact = sdpa_grads(q, k, v, dout, causal)
                    baseline = sdpa_grads(*(t.to(dtype) for t in (q, k, v, dout)), causal)
                    idx = shard_index(layout, world_size, rank, seq).cuda()
                    local = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
                    out = seqpar.attention(*local, mesh=run_mesh, strategy=strategy, causal=causal, layout=layout)
                    out.backward(dout[:, :, idx].to(dtype))
                    got = (out, *(t.grad for t in local))
                    what = f"{strategy} {dtype} {layout} causal={causal} H={heads}/{kv_heads} P={world_size}"
                    _check_shard(what, got, baseline, exact, idx, dtype)
    # packed documents and a sliding window: masked tiles take the efficient kernel, whole ones flash
    from tests._cases import dense_mask, packed_positions

    positions = packed_positions(seq, (70, 300, 33, 129)).cuda()[None].repeat(2, 1)
    for strategy in ("ring", "ulysses", "allgather"):
        for dtype in (torch.float32, torch.bfloat16):
            for window in (None, 96):
                q, k, v, dout = random_case(5, 2, 8, 2, seq, 64)
                mask = dense_mask(positions.cpu(), True, window).cuda()
                exact = sdpa_grads(q, k, v, dout, False, mask)
                baseline = sdpa_grads(*(t.to(dtype) for t in (q, k, v, dout)), False, mask)
                idx = shard_index("zigzag", world_size, rank, seq).cuda()
                local = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
                out = seqpar.attention(
                    *local, mesh=mesh, strategy=strategy, position_ids=positions[:, idx], window=window
                )
                out.backward(dout[:, :, idx].to(dtype))
                what = f"documents {strategy} {dtype} window={window} P={world_size}"
                _check_shard(what, (out, *(t.grad for t in local)), baseline, exact, idx, dtype)
    _llama(rank, world_size, mesh)


def _check_shard(what, got, baseline, exact, idx, dtype):
    check_accuracy(what, got, [t[:, :, idx] for t in baseline], [t[:, :, idx] for t in exact], dtype)


def _llama(rank, world_size, mesh):
    """A prepared tiny Llama on the GPU: logits and loss equal the unprepared model's (fp32, efficient kernel)."""
    import transformers

    from tests._models import tiny_config, tokens

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    ref = ref.cuda().eval()
    for strategy in ("ring", "ulysses", "allgather"):
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy=strategy)
        ids = tokens(2, 48, 1).cuda()
        with torch.no_grad():
            want = ref(input_ids=ids, labels=ids)
            shard = seqpar.shard_batch({"input_ids": ids}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = seqpar.sum_over(seqpar.cross_entropy(logits, shard["shift_labels"], mesh), mesh)
        idx = shard_index("zigzag", world_size, rank, 48).cuda()
        torch.testing.assert_close(logits, want.logits[:, idx], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loss, want.loss, atol=1e-5, rtol=1e-5)


def test_strategies_on_nccl():
    count = torch.cuda.device_count()
    world_size = 4 if count >= 4 else 2 if count >= 2 else 1  # 8 heads divide every one of these
    run_ranks(world_size, _strategies_worker, backend="nccl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sinks_and_softcap(dtype):
    """Sinks on the fused kernels' final (out, lse), soft-capping on the reference kernel (the fused ops take no
    score modification), forward and backward on one GPU, against the float64 eager reference."""
    from tests._sink_cases import eager_attention

    q, k, v, dout = random_case(29, 2, 8, 2, 256, 64)
    z = torch.randn(8, device="cuda", dtype=torch.float64) + 2
    for softcap in (None, 1.5):
        choice = seqpar.choose_attention(q.to(dtype), k.to(dtype), v.to(dtype), softcap=softcap)
        assert (choice.kernel.name == "reference") == (softcap is not None), choice
        ins = [t.clone().requires_grad_() for t in (q, k, v, z)]
        keep = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
        eager_attention(*ins[:3], keep, ins[3], softcap, 64**-0.5).backward(dout)
        got = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [z.float().requires_grad_()]
        out = seqpar.attention(*got[:3], causal=True, sinks=got[3], softcap=softcap)
        out.backward(dout.to(dtype))
        exact = [eager_attention(q, k, v, keep, z, softcap, 64**-0.5)] + [t.grad for t in ins]
        for name, g, e in zip(("out", "dq", "dk", "dv", "dsinks"), [out, *(t.grad for t in got)], exact, strict=True):
            err = rel_err(g.detach(), e.detach())
            assert err <= CAP[dtype], f"{dtype} softcap={softcap} {name}: error {err:.2e}"


HYBRID_KINDS = ("lfm2", "qwen3_next", "kimi_linear", "granitemoehybrid", "mamba", "minimax")
"""One family per mixer adapter: short convolution, gated DeltaNet, KDA, SSD, Mamba1, lightning attention."""


def _hybrid_step(model: torch.nn.Module, ids: torch.Tensor, call: dict) -> tuple[torch.Tensor, float, float]:
    """One forward and backward on the GPU: (logits, seconds, peak GiB above the start)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes, start = torch.cuda.memory_allocated(), torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    logits = model(input_ids=ids, **call).logits
    logits.float().square().mean().backward()
    stop.record()
    torch.cuda.synchronize()
    return logits.detach(), start.elapsed_time(stop) / 1e3, (torch.cuda.max_memory_allocated() - start_bytes) / 2**30


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_hybrid_mixers_on_one_gpu_run_what_one_process_runs(kind, capsys):
    """Note [mixer implementations]: on one GPU each hybrid family's prepared model (P = 1) names the kernel each
    mixer step resolved to (none unreadable) and gives one process's logits (relative to the largest: fp32 1e-4,
    bf16 5e-2 as Note [doctor tolerances] bounds it); its time and peak memory beside one process's are printed
    (a report for the records, no bound)."""
    import transformers

    from seqpar.models import anatomy
    from seqpar.sequence_parallel.mixers import implementations
    from tests._models import tiny_config, tokens

    config = tiny_config(kind)
    config.max_position_embeddings = 256
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).cuda()
    ids = tokens(2, 256, 1).cuda()
    lines = [k.line() for k in implementations(anatomy(ref).mixers, "cuda")]
    assert lines and not any("unknown" in line for line in lines), lines
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        plain = copy.deepcopy(ref).to(dtype)
        prepared = seqpar.prepare_model(copy.deepcopy(ref).to(dtype), None)
        positions = {"position_ids": torch.arange(256, device="cuda")[None].expand(2, -1)}
        for _ in range(2):  # the second run is timed: the first compiles and autotunes the kernels
            want, plain_s, plain_gib = _hybrid_step(plain, ids, {})
            got, seqpar_s, seqpar_gib = _hybrid_step(prepared, ids, positions)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= (1e-4 if dtype == torch.float32 else 5e-2), (kind, dtype, err)
        rows.append(
            f"{dtype}: rel {err:.1e}; time {seqpar_s / plain_s:.2f}x; peak {seqpar_gib:.3f} / {plain_gib:.3f} GiB"
        )
    with capsys.disabled():
        print(f"\n{kind}: " + " | ".join(lines) + "\n  " + "\n  ".join(rows))


def test_opening_piece_in_bf16_on_the_gpu_matches_the_kernel_run_from_the_state():
    """Note [state passing]: the delta rule's opening call (values widened by dk zero columns, the state [0 | I]) on
    the GPU kernel that the dispatcher picks, in bf16: its zero-start output plus the entering state's term equals
    the kernel run from that state, within 4x the distance of that bf16 run from its float32 run."""
    import transformers

    from seqpar.models import anatomy
    from seqpar.sequence_parallel.mixers.gated_deltanet import delta_rule_opening
    from tests._models import tiny_config

    layer = anatomy(transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))).mixers[0]
    kernel = __import__(type(layer).__module__, fromlist=["x"]).torch_chunk_gated_delta_rule
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, dk, dv, length = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, 200
    q, k = (torch.randn(1, length, heads, dk, generator=gen, device="cuda") for _ in range(2))
    v = torch.randn(1, length, heads, dv, generator=gen, device="cuda")
    g = -torch.rand(1, length, heads, generator=gen, device="cuda")
    beta = torch.rand(1, length, heads, generator=gen, device="cuda")
    entering = torch.randn(1, heads, dk, dv, generator=gen, device="cuda")

    def run(q, k, v, g, beta, initial_state):
        return kernel(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)  # fmt: skip

    want32, _ = run(q, k, v, g, beta, entering)
    low = [t.bfloat16() for t in (q, k, v, beta)]  # as the adapter calls it: g in float32, the rest in bf16
    want16, _ = run(*low[:3], g, low[3], entering)
    opened = delta_rule_opening(run, (heads, dk, dv))(*low[:3], g, low[3])
    got = opened.out.float() + opened.respond(entering)
    floor = float((want16.float() - want32).abs().max())
    assert float((got - want32).abs().max()) <= 4 * floor + 1e-3, (floor, float((got - want32).abs().max()))
