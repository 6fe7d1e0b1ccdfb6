"""Attention calls ``seqpar.prepare_diffusers`` serves by gathering every rank's keys (Note [gathered keys]), on gloo
ranks against one process: masks over token pairs, a processor's padding product, keys of a joint sequence.

Each case judges the prediction and every parameter's gradient as the DiT zoo does (``RTOL`` of the float64 scale,
or ``FLOOR_FACTOR`` times the fp32 run's distance from float64), and each exchange has a negative control: the
same run with one part of the exchange switched off must come out WRONG.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.zoo import EXACT, WRONG
from tests._dist import run_ranks

diffusers = pytest.importorskip("diffusers")

_PADDED = 5  # text tokens of HunyuanVideo 1.5's prompt that are padding (the product mask then hides some keys)


def _padded_hunyuan_video15(spec):
    """HunyuanVideo 1.5's zoo batch with the last tokens of both prompts padding."""

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        for key in ("encoder_attention_mask", "encoder_attention_mask_2"):
            batch[key] = batch[key].clone()
            batch[key][:, -_PADDED:] = 0
        return batch

    return dataclasses.replace(spec, inputs=inputs)


def _segmented_ideogram4(spec):
    """Ideogram 4's zoo batch packed as two samples: the text and the first 16 image tokens, then the other 32."""

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        batch["segment_ids"] = batch["segment_ids"].clone()
        batch["segment_ids"][:, 40:] = 2
        return batch

    return dataclasses.replace(spec, inputs=inputs)


def _padded_prx(spec):
    """PRX's zoo batch with the prompt's last tokens padding (its processor joins their mask to the image's keys)."""

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        batch["attention_mask"] = torch.ones(1, batch["encoder_hidden_states"].shape[1], dtype=torch.bool)
        batch["attention_mask"][:, -_PADDED:] = False
        return batch

    return dataclasses.replace(spec, inputs=inputs)


_BATCHES = {
    "PRXTransformer2DModel": _padded_prx,
    "HunyuanVideo15Transformer3DModel": _padded_hunyuan_video15,
    "Ideogram4Transformer2DModel": _segmented_ideogram4,
}


def _ranks_judge(rank: int, world_size: int, name: str, strategy: str, control: str, want: str) -> None:
    """Judge ``name`` at ``world_size`` under ``strategy`` with the exchange's part ``control`` switched off ("" for
    none); assert its status is ``want``."""
    from benchmarks.dit_zoo import judge_class
    from seqpar.integrations import _diffusion_gathered as gathered
    from tests import _dit_zoo

    spec, sdpa, gather, product = _dit_zoo.ZOO[name], gathered._sdpa, gathered.gather_sequence, gathered._product_mask
    joined = gathered._joined_sdpa
    if name in _BATCHES:
        _dit_zoo.ZOO[name] = _BATCHES[name](spec)
    if control == "rank order":  # the keys gathered in rank order, not the layout's global order of the columns
        gathered._sdpa = lambda q, k, v, mask, named, sp, layout: sdpa(q, k, v, mask, named, sp, gathered._RANK_ORDER)
    elif control == "no key gradients back":  # each rank keeps the other ranks' keys' gradients to itself

        def gather_forward(x, sp, dim, layout):
            return gather(x.detach(), sp, dim=dim, layout=layout) if x.requires_grad else gather(x, sp, dim, layout)

        gathered.gather_sequence = gather_forward
    elif control == "joined keys unmasked":  # the key-padding mask of keys joined to a whole text dropped
        gathered._joined_sdpa = lambda q, k, named, mask, *rest: joined(q, k, named, None, *rest)
    elif control == "every key seen":  # the processor's padding product read as all True
        gathered._product_mask = lambda mask, sp, where: torch.ones(
            (*mask.shape[:-1], mask.shape[-1] * sp.sp_size), dtype=torch.bool
        )
    try:
        outcome = judge_class(world_size, name, strategy, False)
    finally:
        _dit_zoo.ZOO[name], gathered._sdpa, gathered.gather_sequence, gathered._product_mask = (
            spec,
            sdpa,
            gather,
            product,
        )
        gathered._joined_sdpa = joined
    assert outcome["status"] == want, (control, outcome)


_MODELS = {
    "Ideogram4Transformer2DModel": "two packed samples' segments over token pairs (a boolean mask)",
    "PRXTransformer2DModel": "image queries against [whole text; image] keys, text padding",
    "NucleusMoEImageTransformer2DModel": "image queries against [image; whole text] keys, text padding",
    "MochiTransformer3DModel": "joint attention in a module of its own class (a row)",
    "HunyuanVideo15Transformer3DModel": "a padding product over each call's own pairs, some text padding",
}


@pytest.mark.parametrize(
    ("world_size", "strategy"), [(2, "ring"), (3, "ring"), (2, "ulysses")], ids=["P2-ring", "P3-ring", "P2-ulysses"]
)
@pytest.mark.parametrize("name", list(_MODELS))
def test_gathered_attention_equals_one_process(name, world_size, strategy):
    run_ranks(world_size, _ranks_judge, name, strategy, "", EXACT)


_CONTROLS = [
    ("Ideogram4Transformer2DModel", "rank order"),
    ("Ideogram4Transformer2DModel", "no key gradients back"),
    ("PRXTransformer2DModel", "no key gradients back"),
    ("PRXTransformer2DModel", "joined keys unmasked"),
    ("NucleusMoEImageTransformer2DModel", "no key gradients back"),
    ("HunyuanVideo15Transformer3DModel", "every key seen"),
]


@pytest.mark.parametrize(("name", "control"), _CONTROLS, ids=[f"{n}-{c}" for n, c in _CONTROLS])
def test_negative_control_each_part_switched_off_comes_out_wrong(name, control):
    run_ranks(2, _ranks_judge, name, "ring", control, WRONG)


def _worst(got: dict, fp32: dict, fp64: dict) -> float:
    """The worst ratio of distance from one process to its bound over named tensors (``benchmarks.zoo.judge``)."""
    from benchmarks.zoo import judge

    return max(judge(n, got[n], fp32[n], fp64[n])[0] for n in got)


def _reduced(tensors: dict) -> dict:
    """The tensors summed over the ranks (each rank holds the gradient of its own queries' part of the loss)."""
    import torch.distributed as dist

    for t in tensors.values():
        dist.all_reduce(t)
    return tensors


_SEQ = 36  # tokens of the lone calls: 2P equal chunks for P = 2, 3


def _pair_mask(kind: str) -> torch.Tensor:
    """``[1, 1, S, S]``: a bidirectional window of 4 (additive, a fully masked row 5 left at the dtype's minimum) or
    random pairs (boolean, rows 0 and 7 seeing no key)."""
    query, key = torch.arange(_SEQ)[:, None], torch.arange(_SEQ)[None, :]
    if kind == "additive window":
        mask = torch.full((_SEQ, _SEQ), torch.finfo(torch.float32).min)
        mask.masked_fill_((query - key).abs() <= 4, 0.0)
        mask[5] = torch.finfo(torch.float32).min
        return mask[None, None]
    seen = torch.rand(_SEQ, _SEQ, generator=torch.Generator().manual_seed(5)) < 0.4
    seen[[0, 7]] = False
    return seen[None, None]


def _rows_call(dtype: torch.dtype, kind: str, mesh=None, layout: str = "zigzag") -> dict:
    """One SDPA call under a mask over token pairs: its output and its inputs' gradients (of this rank's queries'
    part of a fixed weighted sum, where ``mesh`` is given)."""
    import seqpar
    from seqpar.integrations._diffusion_attention import WHERE, Region, ServedSDPA

    gen = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(1, 2, _SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    mask = _pair_mask(kind)
    mask = mask.to(dtype) if mask.is_floating_point() else mask
    if mesh is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        cut = [seqpar.shard_sequence(t, mesh, dim=2, layout=layout) for t in (q, k, v, mask, w)]
        with ServedSDPA(mesh, "ring", layout, where=WHERE, region=Region(tokens=_SEQ)):
            out = torch.nn.functional.scaled_dot_product_attention(*cut[:3], attn_mask=cut[3])
        w = cut[4]
    (out * w.to(dtype)).sum().backward()
    grads = {f"grad {n}": t.grad for n, t in zip("qkv", (q, k, v))}
    return {"output": out.detach(), **(_reduced(grads) if mesh is not None else grads)}


def _rows_worker(rank: int, world_size: int, kind: str, layout: str, control: str, want: str) -> None:
    import seqpar
    from seqpar.integrations import _diffusion_gathered as gathered

    mesh = seqpar.make_mesh()
    fp32, fp64 = _rows_call(torch.float32, kind), _rows_call(torch.float64, kind)
    for ref in (fp32, fp64):
        ref["output"] = seqpar.shard_sequence(ref["output"], mesh, dim=2, layout=layout)
    sdpa = gathered._sdpa
    if control == "rank order":
        gathered._sdpa = lambda q, k, v, mask, named, sp, lay: sdpa(q, k, v, mask, named, sp, gathered._RANK_ORDER)
    try:
        worst = _worst(_rows_call(torch.float32, kind, mesh, layout), fp32, fp64)
    finally:
        gathered._sdpa = sdpa
    assert (worst <= 1.0) == (want == EXACT), (kind, layout, control, worst)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["additive window", "boolean pairs"])
def test_a_mask_over_token_pairs_with_fully_masked_rows_equals_one_process(kind, world_size, layout):
    """Rows that see no key come out as one process's SDPA gives them (zeros for a boolean mask, the mean of every
    value for an additive one at the dtype's minimum), and so do their gradients."""
    run_ranks(world_size, _rows_worker, kind, layout, "", EXACT)


def test_negative_control_keys_gathered_in_rank_order_come_out_wrong():
    run_ranks(2, _rows_worker, "boolean pairs", "zigzag", "rank order", WRONG)


_SEGMENTS = [(0, 8, True), (8, 20, False), (20, 26, True)]
"""Qwen-Image 2.1's runs: a causal prompt, a condition image, another causal prompt; the target image after 26."""


def _segments_call(dtype: torch.dtype, mesh=None, layout: str = "zigzag") -> dict:
    """A lone Qwen-Image 2.1 attention over block-causal runs, two prompt keys padding: its output and gradients."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Attention

    import seqpar
    from seqpar.integrations._diffusion_attention import Region, attention_hooks

    torch.manual_seed(0)
    module = QwenImage21Attention(dim=16, heads=2, dim_head=8).to(dtype)
    gen = torch.Generator().manual_seed(4)
    x, w = (torch.randn(1, _SEQ, 16, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    x.requires_grad_()
    valid = torch.ones(1, _SEQ, dtype=torch.bool)
    valid[:, [5, 22]] = False
    if mesh is not None:
        enter, leave = attention_hooks("attn", mesh, "ring", layout, Region(open=True, tokens=_SEQ))
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
        x, w, valid = (seqpar.shard_sequence(t, mesh, dim=1, layout=layout) for t in (x, w, valid))
    out = module(hidden_states=x, segments=_SEGMENTS, key_valid=valid)
    (out * w).sum().backward()
    grads = {f"grad {n}": p.grad for n, p in module.named_parameters() if p.grad is not None}
    return {"output": out.detach(), **(_reduced(grads) if mesh is not None else grads)}


def _segments_worker(rank: int, world_size: int, layout: str, control: str, want: str) -> None:
    import seqpar
    from seqpar.integrations import _diffusion_attention as attention

    mesh = seqpar.make_mesh()
    fp32, fp64 = _segments_call(torch.float32), _segments_call(torch.float64)
    for ref in (fp32, fp64):
        ref["output"] = seqpar.shard_sequence(ref["output"], mesh, dim=1, layout=layout)
    rows = attention.segment_rows
    if control == "key padding dropped":
        attention.segment_rows = lambda kwargs, *rest: rows({**kwargs, "key_valid": None}, *rest)
    try:
        worst = _worst(_segments_call(torch.float32, mesh, layout), fp32, fp64)
    finally:
        attention.segment_rows = rows
    assert (worst <= 1.0) == (want == EXACT), (layout, control, worst)


@pytest.mark.parametrize(("world_size", "layout"), [(2, "zigzag"), (3, "contiguous"), (3, "zigzag")])
def test_block_causal_runs_served_as_their_rows_equal_one_process(world_size, layout):
    run_ranks(world_size, _segments_worker, layout, "", EXACT)


def test_negative_control_block_causal_runs_without_their_key_padding_come_out_wrong():
    run_ranks(2, _segments_worker, "zigzag", "key padding dropped", WRONG)


def _checkpointed(build):
    """``tests._dit_zoo.build`` with activation checkpointing on: the backward recomputes each block's attention."""

    def built(name: str):
        model, inputs = build(name)
        model.enable_gradient_checkpointing()
        return model, inputs

    return built


def _checkpointed_worker(rank: int, world_size: int, name: str) -> None:
    from tests import _dit_zoo

    build = _dit_zoo.build
    _dit_zoo.build = _checkpointed(build)
    try:
        _ranks_judge(rank, world_size, name, "ring", "", EXACT)
    finally:
        _dit_zoo.build = build


@pytest.mark.parametrize("name", ["Ideogram4Transformer2DModel", "PRXTransformer2DModel"])
def test_gathered_attention_recomputed_under_activation_checkpointing_equals_one_process(name):
    run_ranks(2, _checkpointed_worker, name)


def _refusal_worker(rank: int, world_size: int) -> None:
    """Calls of the gathered kinds seqpar cannot serve raise on every rank, also where one rank alone finds the
    problem (the product check agrees across the ranks before any exchange)."""
    import seqpar
    from seqpar.integrations._diffusion_attention import WHERE, Region, ServedSDPA
    from seqpar.models.diffusion_attention import AttentionRow

    mesh = seqpar.make_mesh()
    q = torch.randn(1, 2, 6, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    product = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    if rank == 1:
        product[..., 2:, :] = False  # rank 1's later queries see no key: still a product
        product[..., 0, 1] = False  # but not one here: refused on rank 1, and so on rank 0 too
    with (
        ServedSDPA(
            mesh, "ring", "zigzag", where=WHERE, region=Region(tokens=12), row=AttentionRow(padding_product=True)
        ),
        pytest.raises(seqpar.SeqparInputError, match=r"rank 1.*not the product of one padding mask"),
    ):
        sdpa(q, q, q, attn_mask=product)
    longer = torch.randn(1, 2, 10, 8)
    with ServedSDPA(mesh, "ring", "zigzag", where=WHERE, region=Region(tokens=12)):
        with pytest.raises(seqpar.SeqparInputError, match="6 queries but 10 keys"):
            sdpa(q, longer, longer)  # keys no row explains: memory tokens every rank holds whole
        with pytest.raises(seqpar.SeqparInputError, match="of 24 keys, not the 12 tokens cut at the first block"):
            rows = torch.ones(1, 1, 12, 24, dtype=torch.bool)  # rows over a sequence twice the tokens cut
            sdpa(*(torch.randn(1, 2, 12, 8) for _ in range(3)), attn_mask=rows)


def test_gathered_calls_seqpar_cannot_serve_raise_on_every_rank():
    run_ranks(2, _refusal_worker)


def _mochi_worker(rank: int, world_size: int, padding: list[int]) -> None:
    """Mochi attends over [video; the text's valid tokens] and puts the valid tokens' outputs first, by their place in
    the text each rank holds: any text padding is refused on every rank (one rank's text may hold none of it)."""
    from benchmarks.dit_zoo import judge_class
    from tests import _dit_zoo

    name = "MochiTransformer3DModel"
    spec = _dit_zoo.ZOO[name]

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        batch["encoder_attention_mask"] = batch["encoder_attention_mask"].clone()
        batch["encoder_attention_mask"][:, padding] = False
        return batch

    _dit_zoo.ZOO[name] = dataclasses.replace(spec, inputs=inputs)
    try:
        outcome = judge_class(world_size, name, "ring", False)
    finally:
        _dit_zoo.ZOO[name] = spec
    assert outcome["status"] == "REFUSED" and "compacts_text" in outcome["reason"], outcome


@pytest.mark.parametrize(
    "padding", [[16, 17, 22, 23], [20, 21, 22, 23]], ids=["two-padding-tokens-on-each-rank", "right-padded"]
)
def test_mochi_text_padding_is_refused_on_every_rank(padding):
    """Without the refusal, two padding tokens on each rank (equal shards) came out WRONG (a gradient 2478 times its
    bound), and a right-padded prompt (unequal shards) was refused by the ring's shapes only."""
    run_ranks(2, _mochi_worker, padding)


_TEXT_KEYS = 10  # text tokens joined to the image's keys in the lone calls


def _joined_call(dtype: torch.dtype, first: bool, form: str, mesh=None, layout: str = "zigzag") -> dict:
    """Image queries against [text; image] keys (``first``, else [image; text]), the text whole, two text keys and
    one image key padding, the mask over this rank's keys (``form`` "local") or every key ("global")."""
    import seqpar
    from seqpar.integrations._diffusion_attention import WHERE, Region, ServedSDPA
    from seqpar.models.diffusion_attention import AttentionRow

    gen = torch.Generator().manual_seed(6)
    q, k, v, w = (torch.randn(1, 2, _SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    tk, tv = (torch.randn(1, 2, _TEXT_KEYS, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v, tk, tv = (t.to(dtype).requires_grad_() for t in (q, k, v, tk, tv))
    text_seen, image_seen = torch.ones(1, _TEXT_KEYS, dtype=torch.bool), torch.ones(1, _SEQ, dtype=torch.bool)
    text_seen[:, [3, 9]], image_seen[:, 30] = False, False

    def joined(text, image):
        return torch.cat([text, image] if first else [image, text], dim=-1 if text.dim() == 2 else -2)

    if mesh is None:
        mask = joined(text_seen, image_seen)[:, None, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, joined(tk, k), joined(tv, v), attn_mask=mask)
    else:
        qs, ks, vs, ws = (seqpar.shard_sequence(t, mesh, dim=2, layout=layout) for t in (q, k, v, w))
        own = seqpar.shard_sequence(image_seen, mesh, dim=1, layout=layout) if form == "local" else image_seen
        row = AttentionRow(text_keys="first" if first else "last")
        with ServedSDPA(mesh, "ring", layout, where=WHERE, region=Region(tokens=_SEQ), row=row):
            mask = joined(text_seen, own)[:, None, None]
            out = torch.nn.functional.scaled_dot_product_attention(qs, joined(tk, ks), joined(tv, vs), attn_mask=mask)
        w = ws
    (out * w.to(dtype)).sum().backward()
    grads = {f"grad {n}": t.grad for n, t in zip(("q", "k", "v", "text k", "text v"), (q, k, v, tk, tv))}
    return {"output": out.detach(), **(_reduced(grads) if mesh is not None else grads)}


def _joined_worker(rank: int, world_size: int, first: bool, form: str, layout: str) -> None:
    import seqpar

    mesh = seqpar.make_mesh()
    fp32, fp64 = (_joined_call(dtype, first, form) for dtype in (torch.float32, torch.float64))
    for ref in (fp32, fp64):
        ref["output"] = seqpar.shard_sequence(ref["output"], mesh, dim=2, layout=layout)
    worst = _worst(_joined_call(torch.float32, first, form, mesh, layout), fp32, fp64)
    assert worst <= 1.0, (first, form, layout, worst)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("form", ["local", "global"])
@pytest.mark.parametrize("first", [True, False], ids=["text-first", "text-last"])
def test_keys_joined_to_a_whole_text_equal_one_process(first, form, world_size, layout):
    """The text's keys' gradients are each rank's queries' share, summed over the ranks as ``reduce_gradients``
    sums a parameter's."""
    run_ranks(world_size, _joined_worker, first, form, layout)
