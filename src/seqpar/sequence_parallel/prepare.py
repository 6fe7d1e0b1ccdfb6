"""Hugging Face transformers models under sequence parallelism, through transformers' ``AttentionInterface``.

``prepare_model`` switches a model's attention to seqpar; the model is then called on ``seqpar.shard_batch`` shards.

Note [transformers integration]
    seqpar registers one attention function under the name "seqpar" with ``AttentionInterface.register`` and
    sets the model's attention implementation to it. No mask function is registered for that name, so the
    model builds no (local, and therefore wrong) 4-D mask: causality, packed documents and sliding windows
    are applied by seqpar over global positions. A forward pre-hook on the model (a documented
    ``nn.Module`` hook, no patching) checks each call, builds the ``SequenceMask`` once per forward from the
    global position ids (one small all-gather), and hands the mesh, strategy and mask to every attention
    layer through the keyword arguments transformers already forwards to attention functions. Its
    checks exchange one small signature first (Note [agreeing on errors]), so a mistake on one rank
    raises on all of them instead of leaving the others in the all-gather. The model's
    own code, weights and RoPE run unchanged on the local shard with global position ids.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.models import ModelAnatomy, find_anatomy
from seqpar.sequence_parallel.api import AttentionChoice, attention, choose_attention
from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext
from seqpar.sequence_parallel.checks import Signature, by_rank, config_digest, config_disagreement, exchange_signatures
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS, PER_BATCH_LAYOUTS, ChunkLayout, Layout, named_layout
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
from seqpar.sequence_parallel.mixers import ADAPTERS, adapt, mismatched_mixers, unknown_mixers
from seqpar.sequence_parallel.strategies.registry import check_strategy_name
from seqpar.sequence_parallel.vision_split import encode_over_group
from seqpar.sequence_parallel.whole_rows import (
    PLACEMENT_KEYWORD,
    ROW_KEY,
    SHARD_REFUSED,
    agree_on_whole_row,
    is_whole_row_call,
    shard_decoder_inputs,
)

__all__ = [
    "ATTENTION_NAME",
    "LAYOUT_KEYWORD",
    "ORIGINAL_ATTENTION_ATTR",
    "PACKING_KEYS",
    "UNSHARDED_ATTR",
    "attention_choice",
    "prepare_model",
]

ATTENTION_NAME = "seqpar"
LAYOUT_KEYWORD = "seqpar_layout"
"""The model-call keyword that carries a batch's own layout (``shard.layout`` of ``shard_batch``); the
forward pre-hook takes it out before the model sees its arguments."""
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Keywords that give varlen kernels a whole row's packed documents; seqpar reads the documents of a shard from
its position ids, so a prepared model's call refuses them (the Trainer doors drop them from their batches)."""
_CONTEXT_KEY = CONTEXT_KEY
_HOOK_ATTR = "_seqpar_forward_hook"
_CHOICE_ATTR = "_seqpar_attention_choices"
ORIGINAL_ATTENTION_ATTR = "_seqpar_original_attention"  # the implementation the model had before prepare_model
UNSHARDED_ATTR = "_seqpar_unsharded"  # True while the model runs its own attention on whole sequences


def _seqpar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``[B, H, S/P, D]`` in, ``([B, S/P, H, D], None)`` out."""
    ctx = kwargs.get(_CONTEXT_KEY)
    if ctx is None:
        raise SeqparInputError(
            "seqpar attention was called without its context: call the model prepared by seqpar.prepare_model "
            "(its forward hook supplies the mesh and mask), not one of its submodules"
        )
    if dropout:
        raise SeqparInputError(f"seqpar attention does not implement attention dropout ({dropout}); set it to 0")
    if kwargs.get("sinks") is not None:  # transformers' name for learned sinks is s_aux; this one is unknown
        raise SeqparInputError("seqpar attention does not know the keyword sinks= (learned sinks come as s_aux=)")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # Gemma 2's cap, gpt-oss's sink logits
    # Under autocast, RoPE promotes q and k back to float32 while v stays in the autocast dtype: attend in
    # the autocast dtype, as the fused SDPA paths do.
    device_type = query.device.type
    target = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    query, key, value = (t.to(target) for t in (query, key, value))
    causal, window = bool(getattr(module, "is_causal", True)), kwargs.get("sliding_window")
    out = attention(
        query,
        key,
        value,
        mesh=ctx.mesh,
        strategy=ctx.strategy,
        causal=causal,
        layout=ctx.layout,
        scale=scaling,
        kernel=ctx.kernel,
        window=window,
        mask=ctx.mask,
        sinks=sinks,
        softcap=softcap,
    )
    # what attention ran, decided by the same function on the same (now checked) inputs and mask
    mask = ctx.mask if window is None else ctx.mask.with_window(window)
    options = dict(mesh=ctx.mesh, strategy=ctx.strategy, kernel=ctx.kernel, softcap=softcap, layout=ctx.layout)
    ctx.choices[getattr(module, "layer_idx", 0)] = choose_attention(
        query, key, value, mask=mask, causal=causal, **options
    )
    return out.transpose(1, 2).contiguous(), None


def _context_in_mask(kwargs: dict) -> bool:
    """The call's mask carries the enclosing call's context (Note [context in the mask])."""
    mask = kwargs.get("attention_mask")
    mask = next(iter(mask.values()), None) if isinstance(mask, dict) else mask
    return isinstance(mask, CallContext)


def _context_to_mask(kwargs: dict, ctx: CallContext, where: str | None, config: object) -> dict:
    """The call's keywords with the context also in its mask, for a family that asks (Note [context in the mask])."""
    if where == "mask":
        kwargs["attention_mask"] = ctx
    elif where == "mapping":  # every layer type's entry of the mask mapping the decoder takes as it is
        kwargs["attention_mask"] = {kind: ctx for kind in getattr(config, "layer_types", ())}
    return kwargs


def _served(model: torch.nn.Module) -> ModelAnatomy | str:
    """The model's anatomy (Note [model families]), or why seqpar cannot serve its attention."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return "it is not a transformers PreTrainedModel"
    found = find_anatomy(model)
    if isinstance(found, str):
        return found
    undeclared = found.undeclared()
    if undeclared:  # it may mix tokens, and would run on each shard alone (Note [declared layer parts])
        shown = "; ".join(undeclared[:3]) + (f" and {len(undeclared) - 3} more" if len(undeclared) > 3 else "")
        return (
            f"its decoder layers hold {shown}, which the {found.family.model_type!r} family entry does not "
            "account for (attention, mixers, MLP, per_token blocks, norms): a module with parameters there may mix "
            "tokens, and each rank would run it on its own shard alone; declare it in the entry (mixers= for a "
            "token mixer seqpar has an adapter for, per_token= for one that acts on each token alone)"
        )
    unknown = unknown_mixers(found.mixers)
    if unknown:  # each rank would run them on its shard alone: wrong, not merely slow (Note [mixer adapters])
        return (
            f"its token mixers {', '.join(unknown)} (besides attention) have no seqpar adapter: each rank would run "
            f"them on its own shard alone; seqpar serves {', '.join(sorted(ADAPTERS))}"
        )
    mismatched = mismatched_mixers(found.mixers)
    if mismatched:  # built by another transformers version than the adapters follow (Note [mixer adapters])
        import transformers

        return (
            f"its token mixers do not have what seqpar's adapters read: {'; '.join(mismatched)} (transformers "
            f"{transformers.__version__}; seqpar's adapters follow the mixers of the versions it declares)"
        )
    attends = any(m is not None for m in found.attention)  # a pure state-space model (Mamba2) has no attention
    if attends and not getattr(model, "_supports_attention_backend", False) and not found.family.attention_interface:
        return (
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            "(its _supports_attention_backend is False)"
        )
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models (cross-attention) are not supported"
    if getattr(config, "attention_dropout", 0.0):
        return f"its attention_dropout is {config.attention_dropout}; seqpar attention has no dropout (set it to 0)"
    text = getattr(found.decoder, "config", None) or config  # a multimodal model's text config
    if getattr(text, "router_jitter_noise", 0.0):
        return (
            f"its router_jitter_noise is {text.router_jitter_noise}: each rank would draw the noise of its own shard, "
            "not one process's draw over the sequence (set it to 0)"
        )
    return found


# One flag of _CallSignature per mistake, with what to do instead.
_CALL_PROBLEMS = {
    "positional_args": "call a seqpar-prepared model with keywords: model(input_ids=..., position_ids=...)",
    "no_position_ids": "a seqpar-prepared model needs position_ids (the global positions of this rank's tokens, "
    "from seqpar.shard_batch); without them RoPE would use local positions",
    "labels": "do not pass labels to a seqpar-prepared model: it would shift them again inside its shard; "
    "compute seqpar.cross_entropy(logits, shard['shift_labels'], mesh) instead",
    "attention_mask": "seqpar reads documents and padding from position_ids and shift_labels; drop attention_mask "
    "(shard_batch already masks padding out of the loss)",
    "use_cache": "seqpar-prepared models train without a KV cache; pass use_cache=False",
    "packing_keys": f"{' / '.join(PACKING_KEYS)} describe a whole row's packed documents, not this rank's shard: "
    "drop them, seqpar reads the documents from position_ids (restarting at 0 at each document start)",
    "no_layout": f"a model prepared with layout='balanced' needs each batch's layout: call it as "
    f"model(input_ids=..., position_ids=..., {LAYOUT_KEYWORD}=shard.layout) with the shard from seqpar.shard_batch",
    "bad_layout": f"{LAYOUT_KEYWORD} must be 'contiguous', 'zigzag' or the ChunkLayout of seqpar.shard_batch "
    f"(shard.layout) for this many ranks",
    "multimodal_keys": f"{', '.join(SHARD_REFUSED)} belong to a whole-row call of a multimodal model (Note "
    "[whole-row calls]); on shards each rank would merge or mask a part of a row (a text model ignores them)",
    "mrope_embeds": "this model numbers image tokens with mRoPE from its whole rows: call it with whole rows "
    "(input_ids, pixel_values, image_grid_thw; Note [whole-row calls]) or with input_ids shards of text, not "
    "with inputs_embeds shards (their [B, S] positions would be wrong for any image token in them)",
    "placeholders": "input_ids hold image or video placeholder tokens but no pixels came with them: call a "
    "multimodal model with whole rows and their pixel_values (Note [whole-row calls])",
}


def _layout_digest(layout: object) -> int:
    """A number the ranks compare to agree on one call's layout (0 when none was passed)."""
    if layout is None:
        return 0
    return (layout.digest if isinstance(layout, ChunkLayout) else zlib.crc32(repr(layout).encode())) + 1


@dataclass(frozen=True)
class _CallSignature(Signature):
    """One model call as the ranks compare it: the mistakes of ``_CALL_PROBLEMS`` and the position ids' shape."""

    positional_args: bool
    no_position_ids: bool
    labels: bool
    attention_mask: bool  # one that masks something out (an all-ones mask is harmless)
    use_cache: bool
    packing_keys: bool
    no_layout: bool
    bad_layout: bool
    multimodal_keys: bool
    mrope_embeds: bool
    placeholders: bool
    config_digest: int  # config_digest of the model's config: every rank must have built the same model
    layout_digest: int  # _layout_digest of the call's layout keyword: every rank must pass the same one
    positions_ndim: int
    positions_dims: tuple[int, int]  # the first two sizes, zero-padded

    @property
    def positions_shape(self) -> list[int]:
        """The position ids' sizes as far as they were sent (at most two)."""
        return list(self.positions_dims[: self.positions_ndim])


def _vision_encoder(model: torch.nn.Module, served: ModelAnatomy, split_vision: object) -> torch.nn.Module:
    """The module whose ``get_image_features`` the model's forward calls (Note [vision split])."""
    if not isinstance(split_vision, bool):
        raise SeqparInputError(f"split_vision must be True or False, got {split_vision!r}")
    try:
        inner = model.get_submodule(served.family.decoder)
    except AttributeError:  # a bare multimodal model, without a head
        return model
    return inner if hasattr(inner, "get_image_features") else model


def _placeholder_ids(config: object) -> list[int]:
    """The image and video placeholder token ids of a multimodal model's config (none for a text model)."""
    names = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
    return [v for v in (getattr(config, n, None) for n in names) if isinstance(v, int)]


def _layout_fault(sp: SequenceParallelMesh, prepared: Layout, call_layout: object) -> tuple[bool, bool]:
    """(no layout where the prepared one is per-batch, a call layout that does not fit the mesh)."""
    fits = isinstance(call_layout, ChunkLayout) and call_layout.world_size == sp.sp_size
    return prepared in PER_BATCH_LAYOUTS and call_layout is None, call_layout is not None and not (
        fits or call_layout in LAYOUTS
    )


def _agree_on_call(
    args: tuple,
    kwargs: dict,
    sp: SequenceParallelMesh,
    prepared: Layout,
    call_layout: object,
    config: object,
    family: object,
) -> None:
    """Check one model call on every rank at once (Note [agreeing on errors]): all raise, or none does."""
    attention_mask = kwargs.get("attention_mask")
    no_layout, bad_layout = _layout_fault(sp, prepared, call_layout)
    ids = kwargs.get("input_ids")
    placeholders = _placeholder_ids(config)
    held = isinstance(ids, torch.Tensor) and bool(placeholders)
    held = held and bool(torch.isin(ids, torch.tensor(placeholders, device=ids.device)).any())
    positions = kwargs.get("position_ids")
    shape = list(positions.shape) if positions is not None else []
    signature = _CallSignature(
        positional_args=bool(args),
        no_position_ids=positions is None,
        labels=kwargs.get("labels") is not None,
        attention_mask=attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()),
        use_cache=bool(kwargs.get("use_cache")),
        packing_keys=any(kwargs.get(k) is not None for k in PACKING_KEYS),
        no_layout=no_layout,
        bad_layout=bad_layout,
        multimodal_keys=any(kwargs.get(k) is not None for k in SHARD_REFUSED),
        mrope_embeds=family.positions == "mrope" and kwargs.get("inputs_embeds") is not None,
        placeholders=held,
        config_digest=config_digest(config),
        layout_digest=_layout_digest(call_layout),
        positions_ndim=len(shape),
        positions_dims=tuple([*shape, 0, 0][:2]),
    )
    table = [signature] if sp.sp_size == 1 else exchange_signatures(signature, sp.sp_group)
    problems = by_rank([[m for name, m in _CALL_PROBLEMS.items() if getattr(row, name)] for row in table])
    same = (table[0].positions_ndim, table[0].positions_dims)
    if not problems and any((row.positions_ndim, row.positions_dims) != same for row in table):
        shapes = "; ".join(f"rank {r}: {row.positions_shape}" for r, row in enumerate(table))
        problems.append(f"position_ids shapes differ across ranks (every rank holds one equal shard): {shapes}")
    differing = config_disagreement([row.config_digest for row in table])
    if not problems and differing:
        problems.append(differing)
    if not problems and any(row.layout_digest != table[0].layout_digest for row in table):
        problems.append(f"the ranks passed different {LAYOUT_KEYWORD} values; pass every rank its shard's layout")
    if problems:
        raise SeqparInputError(" | ".join(problems))


def _implementations(config: object, served: ModelAnatomy) -> str | dict:
    """seqpar's attention for the text decoder; a multimodal model's vision tower keeps its own (whole images)."""
    if served.family.vision is None:
        return ATTENTION_NAME
    text = getattr(served.decoder, "config", None)
    chosen: dict = {"": ATTENTION_NAME}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            chosen[key] = ATTENTION_NAME if sub is text else sub._attn_implementation
    return chosen


def attention_choice(model: torch.nn.Module) -> AttentionChoice | None:
    """The strategy and kernel the first attention layer of a prepared model ran in its last forward.

    Args:
        model: a model returned by ``prepare_model``.

    Returns:
        The choice, or None before the first forward (or for a model seqpar did not prepare).
    """
    choices = getattr(model, _CHOICE_ATTR, None)
    return choices[min(choices)] if choices else None


def prepare_model(
    model: torch.nn.Module,
    mesh: object,
    *,
    strategy: str = "auto",
    layout: Layout = "zigzag",
    kernel: str = "auto",
    split_vision: bool = True,
) -> torch.nn.Module:
    """Make a transformers model run sequence-parallel attention (Note [transformers integration]).

    Idempotent: preparing again replaces the settings. Call the model on ``seqpar.shard_batch`` shards as
    ``model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])`` and compute the loss with
    ``seqpar.cross_entropy`` on its logits, or call ``model.get_decoder()`` the same way for hidden states
    and use ``seqpar.lm_head_cross_entropy`` (logits made in chunks, never all at once).

    Args:
        model: a transformers model of a registered family (``seqpar.models.FAMILIES``: Llama, Qwen2/3,
            Mistral, Gemma 2/3 (soft-capped logits), gpt-oss (attention sinks), ...) whose attention goes
            through ``AttentionInterface``.
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), the SP ProcessGroup, or None.
        strategy: as in ``seqpar.attention``.
        layout: the layout ``shard_batch`` used: "zigzag", "contiguous", or "balanced", "placed" or "auto" (each
            batch brings its own: call the model with ``seqpar_layout=shard.layout``; any call may pass it to
            override).
        kernel: local kernel, as in ``seqpar.attention``.
        split_vision: a multimodal model's whole-row calls encode about 1/P of the images on each rank and
            all-gather the features (Note [vision split]); False: every rank encodes every image.

    Returns:
        The same model object.

    Raises:
        SeqparInputError: a model whose attention seqpar cannot serve (with the reason: an unknown family
            among them; ``seqpar.models.register_family`` adds one), or an unknown strategy.
    """
    from transformers import AttentionInterface

    served = _served(model)
    if isinstance(served, str):
        raise SeqparInputError(f"seqpar cannot serve this model's attention: {served}")
    check_strategy_name(strategy)
    if not isinstance(layout, ChunkLayout):
        named_layout(layout)  # an unknown name raises, listing the registry
    sp = as_sp_mesh(mesh)
    if model.config._attn_implementation != ATTENTION_NAME:  # kept for seqpar.integrations.unsharded
        setattr(model, ORIGINAL_ATTENTION_ATTR, model.config._attn_implementation)
    AttentionInterface.register(ATTENTION_NAME, _seqpar_attention)
    adapt(served.mixers)  # Note [mixer adapters]
    model.set_attn_implementation(_implementations(model.config, served))
    if model.config._attn_implementation != ATTENTION_NAME:
        raise SeqparInputError(f"{type(model).__name__} refused the attention implementation {ATTENTION_NAME!r}")
    for old in getattr(model, _HOOK_ATTR, ()):
        old.remove()
    max_positions = getattr(model.config, "max_position_embeddings", None)
    choices: dict = {}
    setattr(model, _CHOICE_ATTR, choices)
    multimodal = served.family.vision is not None
    encoder = _vision_encoder(model, served, split_vision)

    def check_and_inject(module, args, kwargs):
        if getattr(model, UNSHARDED_ATTR, False):  # whole sequences, the model's own attention (generation)
            return args, kwargs
        if ROW_KEY in kwargs:  # the text decoder of a checked whole-row call (Note [whole-row calls])
            row = kwargs.pop(ROW_KEY)
            kwargs, text = shard_decoder_inputs(kwargs, row, sp)
            batch = kwargs["inputs_embeds"].shape[0]
            mask = sequence_mask(text, sp, layout=row.layout, batch_size=batch, blocks=row.blocks)
            return args, inject(kwargs, row.layout, mask)
        if _CONTEXT_KEY in kwargs or _context_in_mask(kwargs):  # checked by the enclosing model, which passes
            kwargs.pop(LAYOUT_KEYWORD, None)  # its context down (in the mask: Note [context in the mask])
            return args, kwargs
        call_layout = kwargs.pop(LAYOUT_KEYWORD, None)
        placement = kwargs.pop(PLACEMENT_KEYWORD, None)  # a text call's shard is placed already
        batch_layout = call_layout if call_layout is not None else layout
        if multimodal and module is model and is_whole_row_call(kwargs, served.family):
            no_layout, bad_layout = _layout_fault(sp, layout, call_layout)
            kwargs[ROW_KEY] = agree_on_whole_row(
                args,
                kwargs,
                sp,
                served.family,
                batch_layout,
                layout_digest=_layout_digest(call_layout),
                config_digest=config_digest(model.config),
                no_layout=no_layout,
                bad_layout=bad_layout,
                placeholders=tuple(_placeholder_ids(model.config)),
                placement=placement,
            )
            kwargs["use_cache"] = False
            if split_vision and served.family.vision_units and sp.sp_size > 1:
                encode_over_group(encoder, kwargs, sp)
            return args, kwargs
        _agree_on_call(args, kwargs, sp, layout, call_layout, model.config, served.family)
        kwargs["use_cache"] = False
        kwargs.pop("attention_mask", None)
        batch = kwargs["input_ids"].shape[0] if kwargs.get("input_ids") is not None else None
        mask = sequence_mask(kwargs["position_ids"], sp, layout=batch_layout, batch_size=batch)
        return args, inject(kwargs, batch_layout, mask)

    def inject(kwargs: dict, batch_layout: Layout, mask: SequenceMask) -> dict:
        if max_positions is not None and mask.max_position >= max_positions:
            raise SeqparInputError(
                f"position id {mask.max_position} is beyond the model's max_position_embeddings ({max_positions}); "
                "use shorter sequences or documents"
            )
        ctx = kwargs[_CONTEXT_KEY] = CallContext(sp, strategy, batch_layout, kernel, mask, choices)
        return _context_to_mask(kwargs, ctx, served.family.mask_context, model.config)

    # The decoder is hooked too, so that it can be called alone (hidden states for a chunked loss).
    hooked = [model] + ([served.decoder] if served.decoder is not model else [])
    handles = [m.register_forward_pre_hook(check_and_inject, with_kwargs=True) for m in hooked]
    setattr(model, _HOOK_ATTR, handles)
    return model
