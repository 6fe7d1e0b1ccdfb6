"""A model family read from the model itself, for a ``model_type`` the registry has no entry for.

``derive_family(model)`` builds a ``Family`` from transformers' declarations and the module tree (Note [read anatomy]).

Note [read anatomy]
    transformers declares much of a family's anatomy: ``get_decoder()`` finds the text decoder (inside a
    multimodal model too), ``get_output_embeddings()`` the head, the config's ``base_model_pp_plan`` the
    embedding, the layer list and the final norm in order, ``_no_split_modules`` the decoder-layer class, and the
    ``base_model_tp_plan`` the attention and MLP projections of each layer. What the plans leave out is read from
    the module classes: a layer's child is its attention when its class calls transformers' attention functions
    or has an attention adapter (``OWN_ATTENTION``, Note [attention adapters]; its cross-attention over encoder
    states acts on each token), a norm when its class is a norm, an MLP when the tp plan, its name or its class
    says so and it holds no convolution, a mixture of experts when it holds ``experts``; a layer's own linear
    projections act on each token, and so do the parts ``PER_TOKEN_CLASSES`` and ``PER_TOKEN_PARAMETERS`` name
    (read in their source: gates and rates per hidden dimension, projections routed per token). A text decoder
    whose own ``model_type`` has an entry (a registered decoder inside a multimodal model) keeps that entry's
    paths. Nothing is guessed into a part that could mix tokens: a child that fits none of these stays
    undeclared, and the declared-parts rule (Note [declared layer parts]) refuses the model naming it. Refused
    too, by name: an attention module holding a nested block of its own (a sparse-attention indexer selects keys
    seqpar's attention would not see; the indexers and key compressors it serves have rows: Note [indexed
    attention], Note [compressed attention]), layer types whose masks seqpar does not build (``LAYER_MASKS`` holds
    the ones it builds), and
    position biases a family adds to its scores in its own code (ALiBi without an adapter that hands seqpar its
    slopes, a learned relative bias). A multimodal model's vision tower is the one module built from its
    ``vision_config``: calls with images then run whole-row (Note [whole-row calls]), every rank encoding every
    image. A model whose own forward masks image tokens otherwise than causally (``block_sequence_ids``,
    ``token_type_ids``, an ``or_mask_function``: PaliGemma's bidirectional prefix) is served on its text path
    only, and a call with pixels is refused naming that (``Family.images``). The read entry is checked again
    at run time: every attention module that runs must have called seqpar's attention (Note [attention went
    through seqpar]).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.models.families import FAMILIES, Family
from seqpar.models.layer_masks import LAYER_MASKS, LayerMask, layer_mask
from seqpar.models.own_attention import (
    KEY_COMPRESSORS,
    SPARSE_INDEXERS,
    indexed_modules,
    key_compressor,
    own_attention,
    own_positions_class,
    sparse_indexer,
)

if TYPE_CHECKING:
    from torch import nn

_MLP_WORDS = ("mlp", "feedforward", "feed_forward", "ffn", "moe", "experts")
_PLAIN_STYLES = ("colwise", "rowwise")
_OWN_IMAGE_MASKS = ("block_sequence_ids", "or_mask_function", "token_type_ids")  # words of a model's own image masks


@dataclass(frozen=True)
class ImageBlocks:
    """How seqpar serves the image blocks a multimodal model's own code makes (Note [read anatomy])."""

    keyword: str
    """The call keyword whose non-zero entries mark the vision tokens (``Family.image_blocks``)."""
    layers: tuple[str, ...]
    """The layer types that take the blocks (``Family.image_block_layers``)."""
    switch: tuple[str, object]
    """(text config field, value): the blocks apply only when the field holds the value; else images are causal."""
    words: tuple[str, ...]
    """The words of ``_OWN_IMAGE_MASKS`` its model's forward holds for them (no longer a reason to refuse)."""


IMAGE_BLOCKS = {
    # Gemma 4: each run of vision tokens sees itself both ways on the sliding layers, under the window
    "get_block_sequence_ids_for_mask": ImageBlocks(
        "mm_token_type_ids", ("sliding_attention",), ("use_bidirectional_attention", "vision"), ("block_sequence_ids",)
    ),
}
"""A function of a multimodal model's transformers module that makes its image blocks -> how seqpar serves them, in
place of the refusal its own mask would otherwise get."""
_ALWAYS = lambda module: True  # noqa: E731
PER_TOKEN_CLASSES: dict[str, Callable[[nn.Module], bool]] = {
    "ErgoResidualGate": _ALWAYS,
    "MuseSparkResidualGate": _ALWAYS,
    "JetMoeMoA": _ALWAYS,
    "MoshiLinear": lambda module: not module.use_flexible_linear,  # flexible: a weight per depth step
    "Gemma3nTextAltUp": _ALWAYS,
    "Gemma3nTextLaurelBlock": _ALWAYS,
    "HYV4HyperConnection": _ALWAYS,
    "HYV4VLHyperConnection": _ALWAYS,
    "DeepseekV4HyperConnection": _ALWAYS,
}
"""Parts that act on each token alone although no name or class word says so (when the row's test holds), read in
their transformers source: a learned weight per hidden dimension mixing a branch into the residual stream (Ergo,
Muse Spark), a mixture of query and output projections routed per token inside attention (JetMoE), Moshi's
projection where it is one linear map, Gemma 3n's AltUp (its streams mixed by coefficients routed per token) and its
LAuReL low-rank residual, HY-V4's and DeepSeek-V4's hyper-connections (a token's residual streams mixed by weights
computed from that token's streams alone)."""


def _per_token(module: nn.Module) -> bool:
    test = PER_TOKEN_CLASSES.get(type(module).__name__)
    return test is not None and test(module)


PER_TOKEN_PARAMETERS = {"DoryDecoderLayer": ("lambda_1", "lambda_2")}
"""Decoder-layer classes' own parameters that act on each token alone, read in their transformers source: Dory's
per-channel rates of its normalised residual updates."""


def _is_norm(module: nn.Module) -> bool:
    """A norm class by its name (LayerNorm, RMSNorm and their family copies): each acts on one token. Batch, group
    and instance norms are not: they normalise over more than one token."""
    from torch import nn

    name = type(module).__name__.lower()
    across = (nn.modules.batchnorm._NormBase, nn.GroupNorm)  # batch and instance norms share _NormBase
    return (
        "norm" in name and not any(w in name for w in ("batch", "group", "instance")) and not isinstance(module, across)
    )


def _calls_attention_functions(module: nn.Module) -> bool:
    """Its class's forward looks its attention up in transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _nested_block(attention: nn.Module) -> str | None:
    """The name and class of a child of ``attention`` that holds parameterised children of its own, or None."""
    own = own_attention(attention)
    for name, child in attention.named_children():
        if own is not None and name in own.inner:  # the projections its adapter reads (Note [attention adapters])
            continue
        if _per_token(child) or child is sparse_indexer(attention):  # a served indexer: Note [indexed attention]
            continue
        if child is (key_compressor(attention) or (None,))[0]:  # a served compressor: Note [compressed attention]
            continue
        if not _is_norm(child) and any(next(c.parameters(), None) is not None for c in child.children()):
            return f"{name} ({type(child).__name__})"
    return None


def _is_mlp(name: str, module: nn.Module, planned: set[str]) -> bool:
    """Named an MLP by the tp plan, its name or its class, and holding no convolution or pooling (a token window)."""
    from torch import nn

    windows = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
    kind = type(module).__name__.lower()
    named = name in planned or any(word in kind or word == name for word in _MLP_WORDS)
    return named and not any(isinstance(m, windows) for m in module.modules())


def _path_of(root: nn.Module, target: nn.Module) -> str | None:
    return next((name for name, m in root.named_modules() if m is target), None)


def _plan(config: object, name: str) -> dict:
    plan = getattr(config, name, None)
    return dict(plan) if isinstance(plan, dict) else {}


def _layer_classes(module: nn.Module) -> set[str]:
    """The class names transformers keeps whole when it splits the model: its decoder layers among them."""
    return set(getattr(module, "_no_split_modules", None) or ())


def _embedding(text: nn.Module) -> str | None:
    """The path of the text decoder's input embedding: the one it declares, else the pp plan's, else its only one."""
    from torch import nn

    try:
        declared = _path_of(text, text.get_input_embeddings())
    except (AttributeError, NotImplementedError):  # a model class that does not say
        declared = None
    tables = [name for name, child in text.named_children() if isinstance(child, nn.Embedding)]
    planned = [key for key in _plan(getattr(text, "config", None), "base_model_pp_plan") if key in tables]
    if declared or planned:
        return declared or planned[0]
    return tables[0] if len(tables) == 1 else None  # several tables and no word on which: none is guessed


def _decoder_parts(text: nn.Module) -> tuple[str, str, str | None] | str:
    """The text decoder's embedding, layer list and final norm paths, from its pp plan or its children."""
    from torch import nn

    embedding = _embedding(text)
    lists = [name for name, child in text.named_children() if isinstance(child, nn.ModuleList)]
    plan = [key for key in _plan(getattr(text, "config", None), "base_model_pp_plan") if "." not in key]
    planned_lists = [key for key in plan if key in lists]
    layer_lists = [n for n in lists if (c := getattr(text, n)) and type(c[0]).__name__ in _layer_classes(text)]
    candidates = planned_lists if len(planned_lists) == 1 else layer_lists if len(layer_lists) == 1 else lists
    layers = candidates[0] if len(candidates) == 1 else None
    if embedding is None or layers is None:
        return (
            f"{type(text).__name__} names no single input embedding and decoder layer list "
            f"(its module lists: {', '.join(lists) or 'none'})"
        )
    names = list(dict(text.named_children()))
    after = names[names.index(layers) + 1 :]
    norms = [key for key in plan if key in after and _is_norm(getattr(text, key))]
    norms = norms or [key for key in after if _is_norm(getattr(text, key))]
    return embedding, layers, (norms[-1] if norms else None)


def _layer_parts(layers: nn.ModuleList, tp_plan: dict) -> dict | str:
    """A layer's attention, MLP, experts and norm paths, the same in every layer (or the reason not)."""
    from torch import nn

    planned = {key.split(".")[2] for key in tp_plan if key.startswith("layers.*.") and key.count(".") >= 3}
    found: dict = {}
    indexed = indexed_modules(c for layer in layers for c in layer.children())  # Note [indexed attention]
    for i, layer in enumerate(layers):
        attention, mlps, norms, linears = [], [], [], []
        for name, child in layer.named_children():
            own = own_attention(child)  # attention in its own code, served by an adapter (Note [attention adapters])
            if _is_norm(child):
                norms.append(name)
            elif own is not None and name in own.cross:  # over whole encoder states it acts on each token alone
                linears.append(name)
            elif own is not None or _calls_attention_functions(child):
                attention.append(name)
            elif isinstance(child, nn.Linear) or _per_token(child):
                linears.append(name)  # an MLP's projections held by the layer itself (OPT's fc1, fc2), a gate
            elif _is_mlp(name, child, planned) and next(child.parameters(), None) is not None:
                mlps.append(name)
        if len(attention) != 1 or not (mlps or linears):
            known = {*attention, *mlps, *norms, *linears}
            others = [f"{n} ({type(c).__name__})" for n, c in layer.named_children() if n not in known]
            return (
                f"layer {i} ({type(layer).__name__}) holds {len(attention)} attention module(s) that call "
                f"transformers' attention functions or have a seqpar adapter ({', '.join(attention) or 'none'}) "
                f"and {len(mlps)} MLP(s) "
                f"({', '.join(mlps) or 'none'}), where seqpar reads one of each; its other parts: "
                f"{', '.join(others) or 'none'}"
            )
        kind, row = layer_mask(getattr(layer, attention[0])) or (None, LayerMask())
        if row.indexer and id(getattr(layer, attention[0])) not in indexed:
            return (
                f"layer {i} is a sparse-attention layer ({kind}) whose attention "
                f"({type(getattr(layer, attention[0])).__name__}) picks its keys in a way seqpar does not serve (it "
                f"serves the indexers {', '.join(SPARSE_INDEXERS)}: Note [indexed attention])"
            )
        if row.compressed and key_compressor(getattr(layer, attention[0])) is None:
            return (
                f"layer {i} is a compressed-attention layer ({kind}) whose attention "
                f"({type(getattr(layer, attention[0])).__name__}) pools its keys in a way seqpar does not serve (it "
                f"serves the compressors {', '.join(KEY_COMPRESSORS)}: Note [compressed attention])"
            )
        nested = _nested_block(getattr(layer, attention[0]))
        if nested is not None:
            return (
                f"the attention of layer {i} holds {attention[0]}.{nested}, a block of its own that seqpar does "
                "not know (a sparse-attention indexer or similar selects keys seqpar's attention would not see)"
            )
        # several MLP blocks (experts beside a shared MLP): the one with experts is the MLP, the rest act per token
        mlps.sort(key=lambda name: not hasattr(getattr(layer, name), "experts"))
        mlp = getattr(layer, mlps[0]) if mlps else None
        parts = dict(
            attention=attention[0],
            mlp=mlps[0] if mlps else None,
            experts="experts" if hasattr(mlp, "experts") else None,
            layer_norms=tuple(norms),
            per_token=(*mlps[1:], *linears, *PER_TOKEN_PARAMETERS.get(type(layer).__name__, ())),
        )
        if found and parts["layer_norms"] != found["layer_norms"]:  # a layer with more norms than the first
            parts["layer_norms"] = tuple(dict.fromkeys((*found["layer_norms"], *parts["layer_norms"])))
        if found and (parts["attention"], parts["mlp"]) != (found["attention"], found["mlp"]):
            return f"its layers keep attention and MLP under different names ({found} in layer 0, {parts} in layer {i})"
        if found and parts["per_token"] != found["per_token"]:
            return f"its layers hold different projections of their own ({found['per_token']} and {parts['per_token']})"
        found = {**parts, "experts": found.get("experts") or parts["experts"]}
    for i, layer in enumerate(layers):  # a norm path of one layer holds a norm (or nothing) in every layer
        norms = [(n, c) for n, c in layer.named_children() if n in found["layer_norms"]]
        wrong = [f"{n} ({type(c).__name__})" for n, c in norms if not (_is_norm(c) or isinstance(c, nn.Identity))]
        if wrong:
            return f"layer {i} ({type(layer).__name__}) holds {', '.join(wrong)} where other layers hold a norm"
    return found


def _tp_plan(tp_plan: dict, attention: str, mlp: str | None, experts: str | None) -> tuple | None:
    """The family's own per-layer tensor-parallel plan, where it uses only plain column and row splits."""
    rows = []
    for key, style in tp_plan.items():
        if not key.startswith("layers.*."):
            continue
        path = key.removeprefix("layers.*.")
        if style not in _PLAIN_STYLES or path.split(".")[0] not in (attention, mlp or attention):
            return None
        rows.append((path, style))
    if experts is not None or not rows or {style for _, style in rows} != set(_PLAIN_STYLES):
        return None
    return tuple(rows)


def _head(model: nn.Module, text: nn.Module) -> str | None:
    """The output head: the model's declared one, else its one child projecting onto the embedding's vocabulary."""
    from torch import nn

    try:
        declared = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # a model class that does not say
        declared = None
    if isinstance(declared, nn.Module):
        return _path_of(model, declared)
    embedding = _embedding(text)
    vocab = getattr(text.get_submodule(embedding), "num_embeddings", None) if embedding else None
    heads = [n for n, c in model.named_children() if isinstance(c, nn.Linear) and c.out_features == vocab]
    return heads[0] if len(heads) == 1 else None


def _vision_tower(model: nn.Module, decoder: str) -> dict:
    """The multimodal model's vision tower: ``vision``, its path from the model at ``decoder`` (the one child built
    from ``config.vision_config``), or ``images``, why calls with images are refused (no such tower, or the
    model's own code makes image tokens attend otherwise than causally, which seqpar's mask would not do)."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    try:
        outer = model.get_submodule(decoder)
    except AttributeError:
        return {}
    towers = [n for n, c in outer.named_children() if vision is not None and getattr(c, "config", None) is vision]
    if not towers and outer is not model:  # beside the decoder, in the model with the head (Llama 4's vision_model)
        towers = [n for n, c in model.named_children() if vision is not None and getattr(c, "config", None) is vision]
    classes = {type(outer), type(model)}
    sources = "".join(inspect.getsource(cls.forward) for cls in classes if hasattr(cls, "forward"))
    own_masks = [word for word in _OWN_IMAGE_MASKS if re.search(rf"\b{word}\b", sources)]  # not mm_token_type_ids
    served = {}
    for row in (r for f, r in IMAGE_BLOCKS.items() if any(hasattr(sys.modules[c.__module__], f) for c in classes)):
        own_masks = [word for word in own_masks if word not in row.words]
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(text, row.switch[0], None) == row.switch[1]:  # else its images attend causally
            served = {"image_blocks": row.keyword, "image_block_layers": row.layers}
    name = type(model).__name__
    if own_masks:
        return {"images": f"{name} masks its image tokens in its own code ({', '.join(own_masks)}: a bidirectional "
                          "image or prefix block), which seqpar's causal attention would not reproduce; seqpar serves "
                          "its text path only"}  # fmt: skip
    towers = [n for n in towers if "image" in n] if len(towers) > 1 else towers  # Video-LLaVA's image and video
    if len(towers) != 1:
        return {"images": f"{name} holds no single module built from its vision_config that seqpar reads as its "
                          "image tower; seqpar serves its text path only"}  # fmt: skip
    return {"vision": towers[0], **served}


def _rope_fields(config: object) -> object:
    """The config's rotary parameters (``rope_parameters``, or ``rope_scaling`` before them), or None."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


def _unknown_masks(config: object) -> str | None:
    """Why the decoder's attention masks are ones seqpar does not build, or None (``LAYER_MASKS``)."""
    kinds = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind not in LAYER_MASKS})
    if kinds:
        return f"its layer_types hold {', '.join(map(repr, kinds))}, attention masks seqpar does not build"
    if any(getattr(config, name, False) is True for name in ("alibi", "use_alibi")):
        return "its attention adds an ALiBi position bias (config.alibi), which seqpar's attention does not apply"
    read = {LAYER_MASKS[kind].chunk_field for kind in getattr(config, "layer_types", None) or ()}
    if getattr(config, "attention_chunk_size", None) and "attention_chunk_size" not in read:
        size = config.attention_chunk_size
        return (
            f"its attention is chunked (attention_chunk_size={size}) on layers its layer_types do not name, a mask "
            "seqpar does not build"
        )
    return None


def _alibi_served(text: nn.Module) -> bool:
    """The decoder's own-code attention modules all have adapter rows that apply the family's ALiBi slopes
    (``OwnAttention.alibi``), and there is at least one: the bias its decoder builds is then seqpar's to apply."""
    rows = [own_attention(m) for m in text.modules()]
    rows = [row for row in rows if row is not None]
    return bool(rows) and all(row.alibi for row in rows)


def _position_bias(model: nn.Module, text: nn.Module) -> str | None:
    """Why the decoder's attention adds a position bias of its own making that seqpar's attention would not apply
    (each rank would add it over its own shard alone, where it is not refused as a mask tensor), or None."""
    try:
        source = inspect.getsource(type(text).forward)
    except (OSError, TypeError):
        source = ""
    flagged = any(hasattr(getattr(text, "config", None), name) for name in ("alibi", "use_alibi"))  # _unknown_masks
    served = _alibi_served(text)  # every attention module's adapter applies it (Note [ALiBi])
    if not flagged and not served and "alibi" in source.lower():  # Bloom and MPT build it for their own attention
        return (
            f"{type(text).__name__} adds an ALiBi position bias (a slope per head times the key's position) to its "
            "attention scores in its own code, which seqpar's attention does not apply"
        )
    for name, module in model.named_modules():  # T5-style buckets with a learned bias per bucket and head
        if hasattr(module, "relative_attention_bias"):
            return (
                f"its attention adds a learned relative position bias ({name}: {type(module).__name__}), which "
                "seqpar's attention does not apply"
            )
    return None


def _own_positions(text: nn.Module) -> str | None:
    """Why the decoder numbers its tokens itself, not from the call's position ids, or None: its forward takes no
    ``position_ids`` and it holds a position table, which would number every rank's shard from 0."""
    try:
        takes = "position_ids" in inspect.signature(type(text).forward).parameters
    except (TypeError, ValueError):
        takes = True
    tables = [
        f"{n} ({type(c).__name__})"
        for n, c in text.named_children()
        if "position" in type(c).__name__.lower() and own_positions_class(c) is None  # none seqpar's adapter serves
    ]
    if takes or not tables:
        return None
    return (
        f"{type(text).__name__}'s forward takes no position_ids: its {tables[0]} numbers each call's tokens from 0, "
        "so every rank would number its own shard from 0"
    )


def _text_decoder(model: nn.Module) -> nn.Module:
    """The module that holds the decoder layers: transformers' ``get_decoder()`` followed down, else the shallowest
    module holding a list of the model's own decoder-layer class (``_no_split_modules``)."""
    from torch import nn

    found = model
    for _ in range(4):  # a multimodal model's decoder may itself be a model with a head
        inner = found.get_decoder() if callable(getattr(found, "get_decoder", None)) else found
        holds_layers = isinstance(inner, nn.Module) and any(isinstance(m, nn.ModuleList) for m in inner.modules())
        if inner is found or not holds_layers:  # ModernBERT's decoder-named head is a projection, not the decoder
            break
        found = inner
    if found is not model and any(isinstance(c, nn.ModuleList) for c in found.children()):
        return found
    # no get_decoder(), or one that stops at a model with a head (Llama 4's language model): the shallowest holder
    kinds = {k for m in (model, found) for k in getattr(m, "_no_split_modules", None) or ()}
    holders = [
        (name.count("."), name, module)
        for name, module in found.named_modules()
        if any(isinstance(c, nn.ModuleList) and c and type(c[0]).__name__ in kinds for c in module.children())
    ]
    return min(holders, key=lambda h: (h[0], h[1]))[2] if holders else found


def derive_family(model: nn.Module) -> Family | str:
    """Read a transformers model's anatomy from its own declarations and classes (Note [read anatomy]).

    Args:
        model: a transformers model (with a head or a bare decoder) whose ``model_type`` has no registry entry.

    Returns:
        A ``Family`` for it, or a sentence naming what cannot be read.
    """
    model_type = model.config.model_type
    text = _text_decoder(model)
    path = _path_of(model, text) or ""
    decoder, _, text_model = path.partition(".") if path else ("model", "", "")
    text_model = text_model or None
    head = _head(model, text) if text is not model else None
    vision = _vision_tower(model, decoder) if text_model else {}
    if text_model and "mrope_section" in repr(_rope_fields(getattr(text, "config", None))):
        vision["positions"] = "mrope"  # its own code numbers image tokens from the whole row (its calls' checks ask)
    entry = FAMILIES.get(getattr(getattr(text, "config", None), "model_type", None))
    if entry is not None and entry.text_model is None:  # a registered text decoder inside another model
        return dataclasses.replace(entry, model_type=model_type, decoder=decoder, text_model=text_model,
                                   head=head or "lm_head", attention_interface=True, derived=True,
                                   **vision)  # fmt: skip
    masks = _unknown_masks(getattr(text, "config", None)) or _position_bias(model, text) or _own_positions(text)
    if masks:
        return masks
    parts = _decoder_parts(text)
    if isinstance(parts, str):
        return parts
    embedding, layers, norm = parts
    tp_plan = _plan(getattr(text, "config", None), "base_model_tp_plan")
    layer = _layer_parts(getattr(text, layers), tp_plan)
    if isinstance(layer, str):
        return layer
    rotary = next((n for n, child in text.named_children() if "rotary" in type(child).__name__.lower()), None)
    return Family(
        model_type,
        decoder=decoder,
        text_model=text_model,
        layers=layers,
        embedding=embedding,
        norm=norm,
        rotary=rotary,
        head=head or "lm_head",
        tp_plan=_tp_plan(tp_plan, layer["attention"], layer["mlp"], layer["experts"]),
        attention_interface=True,  # checked at run time (Note [attention went through seqpar])
        derived=True,
        **vision,
        **layer,
    )
