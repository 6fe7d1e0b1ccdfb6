"""Diffusers transformers through ``seqpar.prepare_diffusers`` on gloo ranks equal one process, forward and backward.

Tiny Wan 2.x, LTX-Video, CogVideoX, HunyuanVideo, Flux and Qwen-Image models from configs (tests/_dit_models.py):
the gathered prediction, every parameter gradient after the sum over the group, 3 AdamW steps with activation
checkpointing; per-token timesteps; joint text + video attention, with text padding hidden from every query
(HunyuanVideo, Qwen-Image); LoRA, bf16, dp x sp; refusals; cross-attention's bytes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.models import DIFFUSION_PLANS, Split, register_diffusion_plan
from seqpar.runtime.memory import written_bytes
from tests._dist import run_ranks, shard_index
from tests._dit_models import CLASSES, CONFIGS, FRAMES, HEIGHT, PER_TOKEN_TIMESTEPS, TEXT, WIDTH, dit_batch, dit_model
from tests._dit_zoo import build
from tests._floors import FLOOR_FACTOR, StepFloors, assert_near_float64

diffusers = pytest.importorskip("diffusers")

# fp32 on CPU: the prediction within 1e-5 (absolute), each gradient within 1e-5 of its tensor's largest entry;
# parameters after 3 AdamW steps within 4 times their rounding floor of float64's (Note [AdamW floors])
PRED_ATOL, GRAD_REL = 1e-5, 1e-5


def _assert_grads(model, reference, rel: float, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:  # a part the loss does not reach (the text stream after the last joint attention)
            assert p.grad is None, f"{what}: {name} has a gradient that one process does not"
            continue
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=rel * scale + 1e-12, msg=f"{what}: grad of {name}")


def _run_step(model, inputs, target, mesh=None):
    pred = model(**inputs, return_dict=False)[0]
    loss = F.mse_loss(pred, target)
    loss.backward()
    if mesh is not None:
        seqpar.reduce_gradients(model.parameters(), mesh)
    return pred


def _exact_worker(rank, world_size, family, strategy, layout, per_token, ulysses_size):
    reference = dit_model(family)
    model = copy.deepcopy(reference)
    inputs, target = dit_batch(family, per_token)
    want = _run_step(reference, inputs, target)
    mesh = seqpar.make_mesh(ulysses_size=ulysses_size)
    seqpar.prepare_diffusers(model, mesh, strategy=strategy, layout=layout)
    got = _run_step(model, inputs, target, mesh)
    torch.testing.assert_close(got, want, rtol=0, atol=PRED_ATOL, msg="gathered prediction")
    _assert_grads(model, reference, GRAD_REL, f"{family} {strategy}/{layout} P={world_size}")


def _exact_cases() -> list:
    """Every family at P = 2 (ring, ulysses, allgather), 3 (ring) and 4 (ring); Wan also hybrid 2 x 2."""
    cases = []
    for family in CLASSES:
        per_token = family in PER_TOKEN_TIMESTEPS
        runs = [
            (2, "ring", "zigzag", False),
            (2, "ulysses", "contiguous", per_token),
            (2, "allgather", "zigzag", False),
        ]
        runs += [(3, "ring", "contiguous", per_token), (4, "ring", "zigzag", per_token)]
        for world_size, strategy, layout, token_steps in runs:
            name = f"{family}-P{world_size}-{strategy}-{layout}{'-per-token-timesteps' if token_steps else ''}"
            cases.append(pytest.param(family, world_size, strategy, layout, token_steps, 1, id=name))
    cases.append(pytest.param("wan", 4, "hybrid", "contiguous", True, 2, id="wan-P4-hybrid-2x2-per-token-timesteps"))
    return cases


@pytest.mark.parametrize(("family", "world_size", "strategy", "layout", "per_token", "ulysses_size"), _exact_cases())
def test_prediction_and_gradients_equal_one_process(family, world_size, strategy, layout, per_token, ulysses_size):
    run_ranks(world_size, _exact_worker, family, strategy, layout, per_token, ulysses_size)


def _assert_grads_floored(model, reference, exact, what: str) -> None:
    """Each gradient within ``GRAD_REL`` of its float64 scale, or within ``FLOOR_FACTOR`` times one fp32 process's
    distance from float64 where that is larger: a gradient that is zero but for rounding (a key bias that shifts
    every score of a query alike) has no scale of its own."""
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(), exact.parameters(), strict=True):
        bound = GRAD_REL * float(e.grad.abs().max()) + FLOOR_FACTOR * float((q.grad.double() - e.grad).abs().max())
        torch.testing.assert_close(p.grad.double(), e.grad, rtol=0, atol=bound + 1e-12, msg=f"{what}: grad of {name}")


def _sincos_worker(rank, world_size, strategy):
    """CogVideoX as CogVideoX-2b runs (``use_rotary_positional_embeddings=False``: the patch embedding adds sin-cos
    positions of the whole grid, the blocks get no RoPE tables)."""
    reference = dit_model("cogvideox", use_rotary_positional_embeddings=False)
    model, exact = copy.deepcopy(reference), copy.deepcopy(reference).double()
    inputs, target = dit_batch("cogvideox")
    inputs.pop("image_rotary_emb")
    want = _run_step(reference, inputs, target)
    _run_step(exact, _float64(inputs), target.double())
    mesh = seqpar.make_mesh()
    got = _run_step(seqpar.prepare_diffusers(model, mesh, strategy=strategy), inputs, target, mesh)
    torch.testing.assert_close(got, want, rtol=0, atol=PRED_ATOL, msg="gathered prediction")
    _assert_grads_floored(model, reference, exact, f"cogvideox without RoPE {strategy} P={world_size}")


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "ring"), (3, "ulysses")])
def test_cogvideox_without_rotary_embeddings_equals_one_process(world_size, strategy):
    run_ranks(world_size, _sincos_worker, strategy)


def _float64(value):
    """``value`` (a model's keyword arguments, a rotary embedding's tuple) with its floating tensors in float64."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _float64(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_float64(v) for v in value)
    return value


def _adamw_worker(rank, world_size, family, eps):
    """3 AdamW steps with activation checkpointing: every parameter entry within ``FLOOR_FACTOR`` times its rounding
    floor of the float64 model's after the same steps (Note [AdamW floors]; the gradients' rounding measured from
    one process and one whose attention sums in another order, SDPA's math backend instead of its default one).
    Returns the least margin (bound / distance) of seqpar's entries."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    reference = dit_model(family)
    twin, exact, model = copy.deepcopy(reference), copy.deepcopy(reference).double(), copy.deepcopy(reference)
    mesh = seqpar.make_mesh()
    seqpar.prepare_diffusers(model, mesh, strategy="ring")
    model.enable_gradient_checkpointing()
    runs = ((reference, None, False), (twin, None, True), (exact, None, False), (model, mesh, False))

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, eps=eps)

    floors = StepFloors(exact, adamw)
    optimizers = [adamw(m.parameters()) for m, _, _ in runs]
    for step in range(3):
        inputs, target = dit_batch(family, per_token=family in PER_TOKEN_TIMESTEPS, seed=10 + step)
        for (m, group, math), opt in zip(runs, optimizers, strict=True):
            opt.zero_grad()
            with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
                if m is exact:
                    _run_step(m, _float64(inputs), target.double())
                else:
                    _run_step(m, inputs, target, group)
        floors.record(exact, (reference, twin))
        for opt in optimizers:
            opt.step()
    return assert_near_float64(model.named_parameters(), exact, floors.floors(), f"{family} after 3 AdamW steps")


@pytest.mark.parametrize("family", list(CLASSES))
def test_three_adamw_steps_with_gradient_checkpointing_equal_one_process(family):
    # eps 1e-4 (with torch's 1e-8 an entry whose gradient is at fp32's rounding steps by up to lr either way): the
    # floors are tight on most entries
    run_ranks(2, _adamw_worker, family, 1e-4)


@pytest.mark.parametrize("family", ["wan", "cogvideox"])
def test_three_default_adamw_steps_within_four_times_the_rounding_floor(family):
    # torch's default eps (1e-8): the floors of the entries whose gradients are near rounding are about lr a step
    run_ranks(2, _adamw_worker, family, 1e-8)


def _dp_sp_worker(rank, world_size):
    # dp 2 x sp 2: each replica's sp group shares one batch; the mean loss over the replicas' batches, its
    # gradients summed over dp x sp, equals one process on both batches
    mesh = seqpar.make_mesh(sp_size=2, dp_size=2)
    replica = mesh.device_mesh["dp"].get_local_rank()
    reference = dit_model("wan")
    model = copy.deepcopy(reference)
    batches = [dit_batch("wan", per_token=True, seed=20 + r) for r in range(2)]
    for inputs, target in batches:
        F.mse_loss(reference(**inputs, return_dict=False)[0], target).div(2).backward()
    seqpar.prepare_diffusers(model, mesh, strategy="ring")
    inputs, target = batches[replica]
    F.mse_loss(model(**inputs, return_dict=False)[0], target).div(2).backward()
    seqpar.reduce_gradients(model.parameters(), seqpar.data_parallel_group(mesh))
    _assert_grads(model, reference, GRAD_REL, f"dp 2 x sp 2, replica {replica}")


def test_wan_dp2_x_sp2_equals_one_process_on_both_batches():
    run_ranks(4, _dp_sp_worker)


def _lora_worker(rank, world_size):
    from peft import LoraConfig

    reference = dit_model("wan")
    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    reference.add_adapter(lora)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at zero: give it values, so that lora_A's gradient is not zero
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model = copy.deepcopy(reference)
    inputs, target = dit_batch("wan", per_token=False)
    want = _run_step(reference, inputs, target)
    mesh = seqpar.make_mesh()
    seqpar.prepare_diffusers(model, mesh, strategy="ring")
    got = _run_step(model, inputs, target, mesh)
    torch.testing.assert_close(got, want, rtol=0, atol=PRED_ATOL, msg="gathered prediction")
    trained = [(n, p, q) for (n, p), q in zip(model.named_parameters(), reference.parameters()) if p.requires_grad]
    assert trained and all("lora" in n for n, _, _ in trained), [n for n, _, _ in trained]
    for name, p, q in trained:
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=GRAD_REL * scale, msg=f"LoRA grad of {name}")


def test_wan_lora_through_peft_equals_one_process():
    run_ranks(2, _lora_worker)


def _bf16_worker(rank, world_size):
    # bf16 autocast: the sharded run is as close to the fp32 run as one process under autocast is (within 2x,
    # or one bf16 rounding step, 2^-8, of the tensor's largest entry)
    exact, reference = dit_model("wan"), dit_model("wan")
    model = copy.deepcopy(reference)
    inputs, target = dit_batch("wan", per_token=True)
    want = _run_step(exact, inputs, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = _run_step(reference, inputs, target)
        mesh = seqpar.make_mesh()
        seqpar.prepare_diffusers(model, mesh, strategy="ulysses")
        got = _run_step(model, inputs, target, mesh)
    pairs = [("prediction", got, one, want)]
    pairs += [
        (f"grad of {n}", p.grad, q.grad, r.grad)
        for (n, p), q, r in zip(model.named_parameters(), reference.parameters(), exact.parameters())
    ]
    for what, sharded, single, fp32 in pairs:
        bound = max(2 * (single.float() - fp32).abs().max().item(), 2**-8 * fp32.abs().max().item())
        torch.testing.assert_close(sharded.float(), fp32, rtol=0, atol=bound, msg=f"bf16 autocast: {what}")


def test_wan_bf16_autocast_is_as_close_to_fp32_as_one_process():
    run_ranks(2, _bf16_worker)


def _averaged_worker(rank, world_size):
    # Negative control: averaging the gradients over the group (as DDP over these ranks would) is 1/P off.
    reference = dit_model("wan")
    model = copy.deepcopy(reference)
    inputs, target = dit_batch("wan", per_token=False)
    _run_step(reference, inputs, target)
    mesh = seqpar.make_mesh()
    seqpar.prepare_diffusers(model, mesh, strategy="ring")
    _run_step(model, inputs, target, mesh)
    for p in model.parameters():
        p.grad /= world_size
    with pytest.raises(AssertionError, match="grad of"):
        _assert_grads(model, reference, GRAD_REL, "averaged")


def test_negative_control_averaged_gradients_fail():
    run_ranks(2, _averaged_worker)


def _cross_attention_bytes_worker(rank, world_size):
    model = dit_model("wan")
    mesh = seqpar.make_mesh()
    seqpar.prepare_diffusers(model, mesh, strategy="ring")
    spans, attention_spans = [], []

    def measure(module, into):
        start = []
        module.register_forward_pre_hook(lambda *a: start.append(written_bytes()))
        module.register_forward_hook(lambda *a: into.append(written_bytes() - start.pop()))
        module.register_full_backward_pre_hook(lambda *a: start.append(written_bytes()))
        module.register_full_backward_hook(lambda *a: into.append(written_bytes() - start.pop()))

    for block in model.blocks:
        measure(block.attn2, spans)
        measure(block.attn1, attention_spans)
    inputs, target = dit_batch("wan", per_token=False)
    _run_step(model, inputs, target, mesh)
    assert len(spans) == 2 * len(model.blocks) and spans == [0] * len(spans), spans
    # the same probe sees self-attention's exchange, forward and backward (it is not blind)
    assert len(attention_spans) == 2 * len(model.blocks) and min(attention_spans) > 0, attention_spans


def test_cross_attention_moves_no_bytes():
    run_ranks(2, _cross_attention_bytes_worker)


def _refusals_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    with pytest.raises(SeqparInputError, match="no sequence-parallel plan for Linear"):
        seqpar.prepare_diffusers(torch.nn.Linear(2, 2), mesh)
    model = seqpar.prepare_diffusers(dit_model("wan"), mesh, strategy="ring")
    inputs, _ = dit_batch("wan", per_token=False)
    # one rank draws another timestep: every rank raises, before the first collective of attention
    wrong = dict(inputs, timestep=inputs["timestep"] + rank)
    with pytest.raises(SeqparInputError, match=r"differ across the sequence-parallel ranks \(timestep\)"):
        model(**wrong)
    wrong = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, : TEXT - rank])
    with pytest.raises(SeqparInputError, match=r"encoder_hidden_states: rank 0 \[1, 8, 16\], rank 1 \[1, 7, 16\]"):
        model(**wrong)
    # an argument passed on one rank only (the others take its default): equal on every rank after all
    wrong = dict(inputs, encoder_hidden_states_image=None) if rank else inputs
    model(**wrong)
    # return_dict=True (diffusers' default) returns the same gathered sample
    whole = model(**inputs).sample
    torch.testing.assert_close(whole, model(**inputs, return_dict=False)[0], rtol=0, atol=0)
    assert whole.shape == inputs["hidden_states"].shape
    # a joint attention's text that does not divide into the layout: 22 tokens, 4 zigzag chunks
    joint = seqpar.prepare_diffusers(dit_model("cogvideox"), mesh)
    inputs, _ = dit_batch("cogvideox")
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :22]
    with pytest.raises(SeqparInputError, match="input encoder_hidden_states has 22 tokens along dim 1"):
        joint(**inputs)
    inputs, _ = dit_batch("wan", per_token=False)
    # 2 x 5 x 5 = 50 tokens do not divide into 4 zigzag chunks
    odd, _ = dit_batch("wan", per_token=False, height=10)
    with pytest.raises(SeqparInputError, match="has 50 tokens along dim 1, which do not divide into the zigzag"):
        model(**odd)
    with pytest.raises(SeqparInputError, match="the ranks passed different sets of values"):
        seqpar.check_replicated(mesh, **{f"noise{rank}": torch.ones(2)})
    with pytest.raises(SeqparInputError, match=r"values differ across the sequence-parallel ranks \(noise\)"):
        seqpar.check_replicated(mesh, noise=torch.full((2,), float(rank)))
    seqpar.check_replicated(mesh, noise=torch.ones(2), shift=3.0)  # equal: no error
    # an attention mask in self-attention cannot be honoured over the global sequence
    x = torch.randn(1, 36, 48)
    rope = model.rope(torch.randn(1, 4, FRAMES, HEIGHT, WIDTH))
    mask = torch.ones(1, 1, 36, 36, dtype=torch.bool)
    with pytest.raises(SeqparInputError, match="attn_mask is served only as a boolean key-padding mask"):
        model.blocks[0].attn1(x, None, mask, rope)
    skewed = dit_model("wan")
    with torch.no_grad():
        skewed.proj_out.bias.add_(rank)
    with pytest.raises(SeqparInputError, match=r"the model's parameters differ .*\(proj_out\.bias\)"):
        seqpar.prepare_diffusers(skewed, mesh)
    token_replace = diffusers.HunyuanVideoTransformer3DModel(
        **CONFIGS["hunyuan_video"] | dict(image_condition_type="token_replace")
    )
    with pytest.raises(SeqparInputError, match=r"transformer_blocks\.0 is a HunyuanVideoTokenReplaceTransformerBlock"):
        seqpar.prepare_diffusers(token_replace, mesh)
    wan = dit_model("wan")
    wan.blocks[0].ffn.net[1].p = 0.1
    with pytest.raises(SeqparInputError, match=r"blocks\.0\.ffn\.net\.1 has dropout p=0\.1"):
        seqpar.prepare_diffusers(wan, mesh)

    # Lumina's proportional attention scales by the log of the queries a call holds (this rank's share)
    lumina, lumina_inputs = build("LuminaNextDiT2DModel")
    lumina = seqpar.prepare_diffusers(lumina, mesh)
    lumina_inputs["cross_attention_kwargs"] = {"base_sequence_length": 16}
    with pytest.raises(SeqparInputError, match=r"layers\.0\.attn1 is given base_sequence_length: proportional"):
        lumina(**lumina_inputs)

    # a processor that does not call SDPA (another attention backend) would attend to this rank's tokens alone
    wan = seqpar.prepare_diffusers(dit_model("wan"), mesh)
    wan.blocks[1].attn1.set_processor(_NoSDPA())
    with pytest.raises(SeqparInputError, match=r"blocks\.1\.attn1 did not call torch's scaled_dot_product_attention"):
        wan(**inputs)


class _NoSDPA:
    """An attention processor that attends without ``F.scaled_dot_product_attention`` (as a non-native backend)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        weights = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return attn.to_out[0](weights @ v)


def test_bad_input_raises_on_every_rank():
    run_ranks(2, _refusals_worker)


def _off_under_plan(family: str, name: str, shards: dict) -> None:
    """Prepared with the class's plan but for ``shards``, the prediction is not one process's."""
    kept = DIFFUSION_PLANS[name]
    register_diffusion_plan(dataclasses.replace(kept, shards=dict(kept.shards) | shards))
    try:
        reference = dit_model(family)
        model = copy.deepcopy(reference)
        inputs, target = dit_batch(family)
        want = _run_step(reference, inputs, target)
        seqpar.prepare_diffusers(model, seqpar.make_mesh(), strategy="ring")
        got = _run_step(model, inputs, target, seqpar.make_mesh())
    finally:
        register_diffusion_plan(kept)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(got, want, rtol=0, atol=PRED_ATOL)


def _replicated_text_worker(rank, world_size):
    # Negative control: a plan that leaves the text whole on every rank inside the joint attention counts each
    # text key once per rank (what seqpar.context_parallel would do around CogVideoX): the prediction is off.
    name = "CogVideoXTransformer3DModel"
    first = DIFFUSION_PLANS[name].shards["transformer_blocks.0"]
    _off_under_plan("cogvideox", name, {"transformer_blocks.0": {"hidden_states": first["hidden_states"]}})


def test_negative_control_replicated_text_in_joint_attention_fails():
    run_ranks(2, _replicated_text_worker)


def _misaligned_mask_worker(rank, world_size):
    # Negative control: HunyuanVideo's key mask over [video; text] cut as one sequence (not part by part) still
    # has the shard's length, but hides other keys than the text padding: the prediction is off.
    shards = {"*transformer_blocks.*": {"attention_mask": Split(3, 4)}}
    _off_under_plan("hunyuan_video", "HunyuanVideoTransformer3DModel", shards)


def test_negative_control_misaligned_text_padding_mask_fails():
    run_ranks(2, _misaligned_mask_worker)


def _context_parallel_refusal_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    gen = torch.Generator().manual_seed(0)
    tokens, text = torch.randn(1, 4, 16, 8, generator=gen), torch.randn(1, 4, 6, 8, generator=gen)
    with seqpar.context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[2]):
        F.scaled_dot_product_attention(tokens, tokens, tokens)  # the shards themselves: served
        with pytest.raises(SeqparInputError, match=r"not a shard of the sharded buffers.*seqpar\.prepare_diffusers"):
            F.scaled_dot_product_attention(tokens, text, text)  # cross-attention to a text every rank holds
        joint = torch.cat([text, tokens], dim=2)  # [text; shard]: the text's keys would count once per rank
        with pytest.raises(SeqparInputError, match=r"query 14, key 14, value 14 tokens; the shard holds 8"):
            F.scaled_dot_product_attention(joint, joint, joint)


def test_context_parallel_refuses_cross_and_joint_attention_naming_the_door():
    run_ranks(2, _context_parallel_refusal_worker)


def _context_parallel_processor_worker(rank, world_size):
    """Under the drop-in, diffusers' processors say which call is which, whatever the text's length: a text as
    long as the shard (which the lengths alone would take for one) is refused in Wan's cross-attention and in
    CogVideoX's joint attention, on every rank; Wan's self-attention is served and equals one process."""
    mesh = seqpar.make_mesh()
    wan, cogvideox = dit_model("wan").blocks[0], dit_model("cogvideox").transformer_blocks[0]
    gen = torch.Generator().manual_seed(0)
    tokens, wan_text = torch.randn(1, 16, 48, generator=gen), torch.randn(1, 8, 48, generator=gen)
    want = wan.attn1(tokens)
    shard = tokens.clone()
    with torch.no_grad(), seqpar.context_parallel(mesh, buffers=[shard], buffer_seq_dims=[1]):
        assert shard.shape[1] == wan_text.shape[1] == 8  # the text is as long as the shard
        got = wan.attn1(shard)
        with pytest.raises(SeqparInputError, match=r"not a shard.*processor of a WanAttention was given encoder_hid"):
            wan.attn2(shard, encoder_hidden_states=wan_text)
        video, text = torch.randn(1, 8, 64, generator=gen), torch.randn(1, 8, 64, generator=gen)
        with pytest.raises(SeqparInputError, match=r"processor of a Attention was given encoder_hidden_states"):
            cogvideox.attn1(hidden_states=video, encoder_hidden_states=text)
    mine = shard_index("zigzag", world_size, rank, 16)
    torch.testing.assert_close(got, want[:, mine], rtol=1e-5, atol=1e-6)


def test_context_parallel_tells_cross_and_joint_attention_by_the_processors_arguments():
    run_ranks(2, _context_parallel_processor_worker)


def _kept_bytes(model, inputs, target) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one forward and loss (no parameters)."""
    seen = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()}
    total = [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.mse_loss(model(**inputs, return_dict=False)[0], target)
    return total[0]


def _dit_estimate_worker(rank, world_size, family):
    from seqpar.memory import estimate_dit_memory, profile_dit_memory

    tokens_at = {h: FRAMES * (h // 2) ** 2 for h in (8, 16, 24)}
    by_tokens = {n: h for h, n in tokens_at.items()}
    profile = profile_dit_memory(dit_model(family), lambda n: dit_batch(family, height=by_tokens[n]), (32, 128))
    inputs, target = dit_batch(family, height=24)
    one = estimate_dit_memory(profile, tokens_at[24], 1)
    kept_one = _kept_bytes(dit_model(family), inputs, target)
    assert abs((one.kept_blocks + one.kept_outside) / kept_one - 1) < 0.02, (family, one, kept_one)
    model = seqpar.prepare_diffusers(dit_model(family), seqpar.make_mesh(), strategy="ring")
    kept = _kept_bytes(model, inputs, target)
    estimate = estimate_dit_memory(profile, tokens_at[24], world_size, "ring")
    predicted = estimate.kept_blocks + estimate.kept_outside
    assert abs(predicted / kept - 1) < 0.05, (family, rank, predicted, kept)
    assert kept < 0.75 * kept_one  # the blocks' share is what a rank no longer keeps
    assert estimate.step_growth > predicted and estimate.communication == 2 * 2 * 144 * profile.width * 4


@pytest.mark.parametrize("family", ["wan", "hunyuan_video"])
def test_dit_memory_estimate_predicts_each_ranks_kept_activations(family):
    """Note [DiT memory]: a profile traced at 32 and 128 latent tokens predicts what one process keeps at 288
    within 2% and what each of 2 ranks keeps under prepare_diffusers within 5% (measured: 0.6% Wan, 1.8%
    HunyuanVideo)."""
    run_ranks(2, _dit_estimate_worker, family)


def _tail_runs(name: str, loss) -> tuple[dict, dict, dict]:
    """``name``'s zoo build: one process's gradients of ``loss(prediction)``, and the sums over the ranks under
    ``prepare_diffusers`` with the tail's scaling (Note [gathered tail]) and with it switched off (the negative
    control), each as parameter name -> gradient."""
    from seqpar.integrations import diffusion
    from tests._dit_zoo import build

    reference, inputs = build(name)
    mesh = seqpar.make_mesh()
    loss(reference(**inputs, return_dict=False)[0]).backward()
    runs = [{n: p.grad for n, p in reference.named_parameters() if p.grad is not None}]
    guard = diffusion.tail_hooks
    for scaled in (True, False):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        if not scaled:
            diffusion.tail_hooks = lambda model, region, sp_size, handles: handles
        try:
            seqpar.prepare_diffusers(model, mesh)
        finally:
            diffusion.tail_hooks = guard
        loss(model(**inputs, return_dict=False)[0]).backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        runs.append({n: p.grad for n, p in model.named_parameters()})
    return runs[0], runs[1], runs[2]


def _unguarded_tail_worker(rank, world_size):
    """Helios' _cp_plan gathers inside each block, and norm_out and proj_out run on the whole tokens on every rank
    (Note [gathered tail]): with the tail's scaling its gradients are one process's; with it switched off (the
    negative control) they come out once per rank."""
    want, scaled, unscaled = _tail_runs("HeliosTransformer3DModel", torch.Tensor.sum)
    name, tolerance = "proj_out.weight", {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(scaled[name], want[name], **tolerance)
    torch.testing.assert_close(unscaled[name], world_size * want[name], **tolerance)


def test_a_cp_plan_gathering_inside_the_blocks_trains_its_tail_once():
    run_ranks(2, _unguarded_tail_worker)


def _gathered_tail_worker(rank, world_size):
    """Stable Audio's postprocess_conv runs on the gathered output on every rank (Note [gathered tail]): the door
    scales its gradients by 1 / P, so the sum over the ranks is one process's; with the tail's hooks switched off
    (the negative control) they come out once per rank."""
    want, scaled, unscaled = _tail_runs("StableAudioDiTModel", lambda out: out.square().sum())
    for name in ("postprocess_conv.weight", "transformer_blocks.0.attn1.to_q.weight"):
        factor = world_size if name.startswith("postprocess") else 1
        for got, times in ((scaled, 1), (unscaled, factor)):
            torch.testing.assert_close(got[name], times * want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_tail_after_the_gather_trains_as_in_one_process(world_size):
    run_ranks(world_size, _gathered_tail_worker)
