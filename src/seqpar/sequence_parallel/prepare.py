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

Note [attention went through seqpar]
    A family's attention is served only if its attention modules call the function transformers' attention
    interface hands them (or, where a class computes its softmax in its own code, whose adapter calls seqpar's
    attention: Note [attention adapters]). One that computes its softmax in its own code without an adapter, or
    switches backend on its own, would attend over its local shard alone and run silently wrong. So each
    attention module the anatomy names (and each adapted cross-attention) gets a forward pre-hook that takes it
    off the call context's ``attended`` set, seqpar's attention puts the calling module back on it, and a
    forward hook checks, as the module returns, that it is there; one that is not raises, naming the module,
    before its output reaches the loss. Every rank runs the same code, so every rank
    raises at the same module. The check costs a set lookup per layer and holds for every call (and for each
    recomputation under activation checkpointing), so an entry read from the model (Note [read anatomy]) and
    one written by hand are checked alike.

Note [keywords dropped]
    Some families drop the keywords on the way down: Falcon's model with a head calls its decoder with a fixed
    list of arguments, StableLM's layers call their attention without the layer's keywords, so the call
    context never reaches seqpar's attention there. While a checked call runs, its context is therefore also
    held by the prepared model's hooks (from the hooked module's pre-hook to its forward hook, which runs even
    when the forward raises): the decoder's pre-hook and each attention module's pre-hook add it to their
    keywords where it is missing. Outside a call nothing is held, so a submodule called alone still raises
    for want of its context, and activation checkpointing of such a family recomputes a layer with the
    keywords its forward got, which lack the context: it raises the same way, never runs unmasked.
"""

from __future__ import annotations

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.models import ModelAnatomy, find_anatomy
from seqpar.models.layer_masks import layer_chunk, layer_mask
from seqpar.models.own_attention import indexed_modules, key_compressor, sparse_indexer
from seqpar.sequence_parallel._own_config import config_tree, own_config
from seqpar.sequence_parallel.api import AttentionChoice, attention_and_choice
from seqpar.sequence_parallel.attention_adapters import (
    ALIBI_KEY,
    adapt_attention,
    adapted_only,
    cross_attention,
    position_tables,
    unfit_attention,
)
from seqpar.sequence_parallel.call_checks import (
    LAYOUT_KEYWORD,
    WIDTH_KEYWORD,
    agree_on_call,
    layout_digest,
    layout_fault,
    placeholder_ids,
)
from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext
from seqpar.sequence_parallel.checks import config_digest
from seqpar.sequence_parallel.compressed import compressed_call, compressor_hooks
from seqpar.sequence_parallel.indexed import indexed_attention, indexer_arguments, picked_keys, visibility
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout, Layout, named_layout
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
from seqpar.sequence_parallel.mixers import ADAPTERS, adapt, mismatched_mixers, unknown_mixers
from seqpar.sequence_parallel.strategies.registry import check_strategy_name
from seqpar.sequence_parallel.vision_split import encode_over_group
from seqpar.sequence_parallel.whole_rows import (
    PLACEMENT_KEYWORD,
    ROW_KEY,
    agree_on_whole_row,
    is_whole_row_call,
    shard_decoder_inputs,
)

ATTENTION_NAME = "seqpar"
_UNAPPLIED = ("position_bias", "indices", "block_indices")  # attention keywords seqpar's attention has no use for
_JITTER = ("router_jitter_noise", "moe_jitter_eps")  # config fields of routers that draw noise per token in training
_CONTEXT_KEY = CONTEXT_KEY
_HOOK_ATTR = "_seqpar_forward_hook"
_CHOICE_ATTR = "_seqpar_attention_choices"
ORIGINAL_ATTENTION_ATTR = "_seqpar_original_attention"  # the implementation the model had before prepare_model
PREPARED_ATTENTION_ATTR = "_seqpar_prepared_attention"  # what prepare_model set: seqpar's, per sub-config
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
    if (out := compressed_call(module, query, key, value, scaling, ctx, kwargs)) is not None:  # pooled keys too
        return out, None
    allowed = picked_keys(module, attention_mask, kwargs, ctx)  # a sparse layer's picks (Note [indexed attention])
    if allowed is not None:
        ctx.attended.add(id(module))
        out, ctx.choices[getattr(module, "layer_idx", 0)] = indexed_attention(
            query, key, value, allowed, scaling, ctx, kwargs.get("s_aux")
        )
        return out.transpose(1, 2).contiguous(), None
    if isinstance(attention_mask, torch.Tensor):  # seqpar's calls build none: the family made its own (ALiBi)
        raise SeqparInputError(
            f"{type(module).__name__} handed seqpar's attention a mask or bias tensor of its own making (an additive "
            "position bias such as ALiBi, or a mask seqpar does not build), which seqpar's attention would not "
            "apply; seqpar serves attention whose masks it builds from the global position ids"
        )
    unapplied = [k for k in _UNAPPLIED if kwargs.get(k) is not None]
    if unapplied:  # a position bias or a sparse selection the family computed over its own shard
        raise SeqparInputError(
            f"{type(module).__name__} handed seqpar's attention {', '.join(unapplied)}= (a position bias, or the keys "
            "a sparse indexer selected), which seqpar's attention does not apply"
        )
    if kwargs.get("sinks") is not None:  # transformers' name for learned sinks is s_aux; this one is unknown
        raise SeqparInputError("seqpar attention does not know the keyword sinks= (learned sinks come as s_aux=)")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # Gemma 2's cap, gpt-oss's sink logits
    # Under autocast, RoPE promotes q and k back to float32 while v stays in the autocast dtype: attend in
    # the autocast dtype, as the fused SDPA paths do.
    device_type = query.device.type
    target = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    query, key, value = (t.to(target) for t in (query, key, value))
    causal = kwargs.get("is_causal")  # as transformers' SDPA reads it: the call's flag, else the module's
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = kwargs.get("sliding_window")
    kind, _ = layer_mask(module) or (None, None)
    mask = ctx.mask if ctx.block_layers is None or kind in ctx.block_layers else ctx.mask.without_blocks()
    out, choice = attention_and_choice(
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
        mask=mask,  # a layer type that does not take the image blocks sees its documents causally
        sinks=sinks,
        softcap=softcap,
        alibi=kwargs.get(ALIBI_KEY),  # an adapter's ALiBi slopes (Note [ALiBi]); no transformers family passes it
        chunk=layer_chunk(module),  # Llama 4's chunked layers (Note [chunked attention])
    )
    ctx.choices[getattr(module, "layer_idx", 0)] = choice
    ctx.attended.add(id(module))
    return out.transpose(1, 2).contiguous(), None


def _context_in_mask(kwargs: dict) -> bool:
    """The call's mask carries the enclosing call's context (Note [context in the mask])."""
    mask = kwargs.get("attention_mask")
    mask = next(iter(mask.values()), None) if isinstance(mask, dict) else mask
    return isinstance(mask, CallContext) or isinstance(kwargs.get("state"), CallContext)


def _context_to_mask(kwargs: dict, ctx: CallContext, where: str | None, config: object) -> dict:
    """The call's keywords with the context also in its mask, for a family that asks (Note [context in the mask])."""
    if where == "mask":
        kwargs["attention_mask"] = ctx
    elif where == "mapping":  # every layer type's entry of the mask mapping the decoder takes as it is
        kwargs["attention_mask"] = {kind: ctx for kind in getattr(config, "layer_types", ())}
    elif where == "state":  # the recurrent state the decoder hands every block (RWKV)
        kwargs["state"] = ctx
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
    unfit = unfit_attention(found)
    if unfit:  # attention in its own code without a fitting adapter would attend over each shard alone
        return f"its attention cannot be adapted: {'; '.join(unfit)} (Note [attention adapters])"
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
    for part in config_tree(text):  # DBRX keeps its router's jitter in a sub-config
        noisy = next((name for name in _JITTER if getattr(part, name, None)), None)
        if noisy is not None:
            return (
                f"its {noisy} is {getattr(part, noisy)}: each rank would draw the noise of its own shard, not one "
                "process's draw over the sequence (set it to 0)"
            )
    return found


def unserved_reason(model: torch.nn.Module) -> str | None:
    """Why ``prepare_model`` would refuse ``model`` (a sentence), or None when it serves it; runs nothing."""
    found = _served(model)
    return found if isinstance(found, str) else None


def _vision_encoder(model: torch.nn.Module, served: ModelAnatomy, split_vision: object) -> torch.nn.Module:
    """The module whose ``get_image_features`` the model's forward calls (Note [vision split])."""
    if not isinstance(split_vision, bool):
        raise SeqparInputError(f"split_vision must be True or False, got {split_vision!r}")
    try:
        inner = model.get_submodule(served.family.decoder)
    except AttributeError:  # a bare multimodal model, without a head
        return model
    return inner if hasattr(inner, "get_image_features") else model


def _implementations(config: object, served: ModelAnatomy) -> str | dict:
    """seqpar's attention for the text decoder; a multimodal model's other towers keep their own (whole images)."""
    text = getattr(served.decoder, "config", None)
    if served.family.vision is None and text is config:
        return ATTENTION_NAME
    chosen: dict = {"": ATTENTION_NAME}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            chosen[key] = ATTENTION_NAME if sub is text else sub._attn_implementation
    return chosen


def is_prepared(model: torch.nn.Module) -> bool:
    """Whether ``prepare_model`` prepared ``model`` (its config may still name another attention: a family served
    by attention adapters keeps the one transformers would not switch, Note [attention adapters]).

    Args:
        model: any model.

    Returns:
        True for a model returned by ``prepare_model``.
    """
    return getattr(model, PREPARED_ATTENTION_ATTR, None) is not None


def last_attention_choice(model: torch.nn.Module) -> AttentionChoice | None:
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
            Mistral, Gemma 2/3 (soft-capped logits), gpt-oss (attention sinks), hybrids, ...) or one whose
            anatomy seqpar reads from the model (Note [read anatomy]), whose attention goes through
            ``AttentionInterface`` (checked at run time: Note [attention went through seqpar]).
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), the SP ProcessGroup, or None.
        strategy: as in ``seqpar.attention``.
        layout: the layout ``shard_batch`` used: "zigzag", "contiguous", or "balanced", "placed" or "auto" (each
            batch brings its own: call the model with ``seqpar_layout=shard.layout``; any call may pass it to
            override).
        kernel: local kernel, as in ``seqpar.attention``.
        split_vision: a multimodal model's whole-row calls encode about 1/P of the images on each rank and
            all-gather the features (Note [vision split]); False: every rank encodes every image.

    Returns:
        The same model object, with its own copy of its config (the caller's config object is left as it was:
        other models built from it keep their attention; Note [the model's own config]).

    Raises:
        SeqparInputError: a model whose attention seqpar cannot serve (with the reason: a family whose parts
            cannot be read among them; ``seqpar.models.register_family`` describes one), or an unknown strategy.
    """
    from transformers import AttentionInterface

    served = _served(model)
    if isinstance(served, str):
        raise SeqparInputError(f"seqpar cannot serve this model's attention: {served}")
    check_strategy_name(strategy)
    if not isinstance(layout, ChunkLayout):
        named_layout(layout)  # an unknown name raises, listing the registry
    calls = _PreparedCalls(model, served, as_sp_mesh(mesh), strategy, layout, kernel, split_vision)
    own_config(model)  # the caller's config, which other models may share, stays as it was
    if model.config._attn_implementation != ATTENTION_NAME:  # kept for seqpar.integrations.unsharded
        setattr(model, ORIGINAL_ATTENTION_ATTR, model.config._attn_implementation)
    AttentionInterface.register(ATTENTION_NAME, _seqpar_attention)
    adapt(served.mixers)  # Note [mixer adapters]
    adapt_attention(served, _seqpar_attention)  # Note [attention adapters]
    chosen = _implementations(model.config, served)
    model.set_attn_implementation(chosen)
    text_config = getattr(served.decoder, "config", model.config)  # what the text decoder's attention reads
    attends = any(m is not None for m in served.attention)  # RWKV has no attention: none reads the implementation
    if text_config._attn_implementation != ATTENTION_NAME and attends and not adapted_only(served):
        raise SeqparInputError(f"{type(model).__name__} refused the attention implementation {ATTENTION_NAME!r}")
    setattr(model, PREPARED_ATTENTION_ATTR, chosen)  # only a model that took it counts as prepared
    for old in getattr(model, _HOOK_ATTR, ()):
        old.remove()
    setattr(model, _CHOICE_ATTR, calls.choices)
    # The decoder is hooked too, so that it can be called alone (hidden states for a chunked loss).
    hooked = [model] + ([served.decoder] if served.decoder is not model else [])
    hooks = [m.register_forward_pre_hook(calls, with_kwargs=True) for m in hooked]
    hooks += [m.register_forward_hook(calls.finished, always_call=True) for m in hooked]
    for module in (*filter(None, served.attention), *cross_attention(served)):  # Note [attention went through seqpar]
        hooks.append(module.register_forward_pre_hook(calls.entering_attention, with_kwargs=True))
        hooks.append(module.register_forward_hook(calls.leaving_attention))
        if (indexer := sparse_indexer(module)) is not None:  # its keys gathered (Note [indexed attention])
            hooks.append(indexer.register_forward_pre_hook(calls.entering_indexer, with_kwargs=True))
        if (compressor := key_compressor(module)) is not None:  # its inputs gathered (Note [compressed attention])
            hooks += compressor_hooks(module, *compressor, lambda: calls.running)
    for table in position_tables(served):  # handed the context its decoder does not pass (Note [attention adapters])
        hooks.append(table.register_forward_pre_hook(calls.entering_attention, with_kwargs=True))
    setattr(model, _HOOK_ATTR, hooks)
    return model


class _PreparedCalls:
    """A prepared model's forward pre-hook: checks each call on every rank and hands its layers the context.

    A call is one of: the model's own attention on whole sequences (generation, left alone), the text decoder
    of a checked whole-row call, a layer called from within a checked call (its context already passed down),
    a multimodal model's whole-row call, or a call on shards.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        served: ModelAnatomy,
        sp: SequenceParallelMesh,
        strategy: str,
        layout: Layout,
        kernel: str,
        split_vision: bool,
    ) -> None:
        self.model, self.served, self.sp = model, served, sp
        self.strategy, self.layout, self.kernel = strategy, layout, kernel
        self.split_vision = split_vision and served.family.vision_units and sp.sp_size > 1
        self.encoder = _vision_encoder(model, served, split_vision)
        self.choices: dict = {}
        self.attended: set[int] = set()  # Note [attention went through seqpar]
        self.indexed = indexed_modules(served.attention)  # DSA layers, with or without their own indexer
        self.running: CallContext | None = None  # the context of the call in progress (Note [keywords dropped])
        self.running_from: torch.nn.Module | None = None  # the hooked module that call entered by

    def __deepcopy__(self, memo: dict) -> _PreparedCalls:
        # A copied model (a pipeline stage's frame) keeps its hooks as it would keep a function: shared, since
        # the mesh's process groups cannot be copied.
        return self

    def entering_attention(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.attended.discard(id(module))
        if self.running is not None and id(module) in self.indexed:  # Note [indexed attention]
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            kwargs["attention_mask"] = visibility(self.running, hidden.shape[0], hidden.shape[1], hidden.device)
        if self.running is None or _CONTEXT_KEY in kwargs or _context_in_mask(kwargs):
            return args, kwargs
        return args, {**kwargs, _CONTEXT_KEY: self.running}  # a layer that drops keywords (Note [keywords dropped])

    def entering_indexer(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.running is not None:  # its keys gathered in global order (Note [indexed attention])
            return indexer_arguments(module, args, kwargs, self.running)
        return args, kwargs

    def finished(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if module is self.running_from:
            self.running, self.running_from = None, None

    def leaving_attention(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if id(module) in self.attended or getattr(self.model, UNSHARDED_ATTR, False):
            return
        raise SeqparInputError(
            f"{self.served.name(module)} ({type(module).__name__}) ran without calling seqpar's attention: its "
            "family computes attention in its own code or picks its own backend, so each rank would attend over "
            "its own shard alone; seqpar serves attention that goes through transformers' AttentionInterface "
            "(Note [attention went through seqpar])"
        )

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if getattr(self.model, UNSHARDED_ATTR, False):  # whole sequences, the model's own attention
            return args, kwargs
        if ROW_KEY in kwargs:  # the text decoder of a checked whole-row call (Note [whole-row calls])
            return args, self._decoder_of_row(kwargs)
        call_layout, width = kwargs.pop(LAYOUT_KEYWORD, None), kwargs.pop(WIDTH_KEYWORD, None)
        width = None if width == 0 else width  # a padding batch's (a replica with no rows): no token of its own
        if _CONTEXT_KEY in kwargs or _context_in_mask(kwargs):  # checked by the enclosing model, which passes
            return args, kwargs  # its context down (in the mask: Note [context in the mask])
        if module is not self.model and self.running is not None:  # the decoder, called by the checked model
            # without the keywords it was given (Note [keywords dropped])
            return args, {**kwargs, _CONTEXT_KEY: self.running, "use_cache": False}
        placement = kwargs.pop(PLACEMENT_KEYWORD, None)  # a text call's shard is placed already
        family = self.served.family
        self.running, self.running_from = None, module
        if family.vision is not None and module is self.model and is_whole_row_call(kwargs, family):
            return args, self._whole_row(args, kwargs, call_layout, placement)
        config = self.model.config
        agree_on_call(args, kwargs, self.sp, self.layout, call_layout, config, family, width)
        kwargs["use_cache"] = False
        kwargs.pop("attention_mask", None)
        batch_layout = call_layout if call_layout is not None else self.layout
        batch = kwargs["input_ids"].shape[0] if kwargs.get("input_ids") is not None else None
        mask = sequence_mask(kwargs["position_ids"], self.sp, layout=batch_layout, batch_size=batch)
        return args, self._inject(kwargs, batch_layout, mask, width)

    def _whole_row(self, args: tuple, kwargs: dict, call_layout: object, placement: object) -> dict:
        """A multimodal model's whole-row call, checked on every rank; its images encoded over the group."""
        no_layout, bad_layout = layout_fault(self.sp, self.layout, call_layout)
        kwargs[ROW_KEY] = agree_on_whole_row(
            args,
            kwargs,
            self.sp,
            self.served.family,
            call_layout if call_layout is not None else self.layout,
            layout_digest=layout_digest(call_layout),
            config_digest=config_digest(self.model.config),
            no_layout=no_layout,
            bad_layout=bad_layout,
            placeholders=tuple(placeholder_ids(self.model.config)),
            placement=placement,
        )
        kwargs["use_cache"] = False
        if self.split_vision:
            encode_over_group(self.encoder, kwargs, self.sp)
        return kwargs

    def _decoder_of_row(self, kwargs: dict) -> dict:
        """The text decoder's inputs of a whole-row call: this rank's share, with the whole row's mask."""
        row = kwargs.pop(ROW_KEY)
        kwargs, text = shard_decoder_inputs(kwargs, row, self.sp)
        batch = kwargs["inputs_embeds"].shape[0]
        mask = sequence_mask(text, self.sp, layout=row.layout, batch_size=batch, blocks=row.blocks)
        return self._inject(kwargs, row.layout, mask)

    def _inject(self, kwargs: dict, batch_layout: Layout, mask: SequenceMask, width: int | None = None) -> dict:
        """The call's keywords with the context its layers read (Note [context in the mask])."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and mask.max_position >= limit:
            raise SeqparInputError(
                f"position id {mask.max_position} is beyond the model's max_position_embeddings ({limit}); "
                "use shorter sequences or documents"
            )
        positions = kwargs.get("position_ids")  # for a position table its decoder does not hand them to
        ctx = self.running = kwargs[_CONTEXT_KEY] = CallContext(
            self.sp, self.strategy, batch_layout, self.kernel, mask, self.choices, self.attended, positions, width,
            self.served.family.image_block_layers,
        )  # fmt: skip
        return _context_to_mask(kwargs, ctx, self.served.family.mask_context, self.model.config)
