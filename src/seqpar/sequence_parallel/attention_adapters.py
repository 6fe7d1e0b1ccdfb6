"""Attention that computes its softmax in its own code, served under sequence parallelism: one adapter per class.

``prepare_model`` swaps each such module's class for its adapter, which attends through seqpar's attention function.

Note [attention adapters]
    Some families' attention modules (GPT-Neo, OpenAI GPT, XGLM, TrOCR, GPT-NeoX-Japanese) never call
    transformers' attention interface: they multiply queries by keys and take the softmax in their own
    ``forward``, so on a shard each rank would attend over its own tokens alone. Each such class has a row,
    keyed by its transformers class name: ``OWN_ATTENTION`` (seqpar.models.own_attention, read by the anatomy
    reader) names the transformers module that defines it, so a class of the same name elsewhere is not taken
    for it, and ``ADAPTERS`` here holds its ``forward``. That ``forward`` computes q, k and v with the module's
    own projections (and the family's rotary on the cos/sin the model made from the global position ids),
    hands them to seqpar's attention function with the family's scale (1 for GPT-Neo, none unless OpenAI GPT's
    ``scale`` flag is set, 1/sqrt(d) for the others) and window (GPT-Neo's local layers), and applies the
    module's output projection. seqpar's attention records the module in ``ctx.attended`` (Note [attention went
    through seqpar]) and applies every strategy, packed documents and windows from the call context's mask. As
    with mixers (Note [mixer adapters]), ``prepare_model`` sets the module's ``__class__`` to a subclass that
    overrides ``forward`` only, so parameters, their names, the state dict and hooks stay the model's. A row
    lists the attributes (dotted paths) and the functions of the class's transformers module that its
    ``forward`` reads; a module lacking one, as another transformers version may build it, is refused by name.
    Called without a call context (the model unsharded for generation; a submodule called alone, which the run-
    time check then refuses) the subclass runs the class's own ``forward``. A cross-attention module (the row's
    ``cross`` names: XGLM's and TrOCR's ``encoder_attn``) is adapted and hooked too, and refuses encoder states
    inside a sharded call: seqpar checks neither that every rank holds the same ones nor their mask. A position
    table whose decoder does not hand it the position ids (TrOCR's learned one counts each call's tokens from 0)
    has a row too (``OWN_POSITIONS``, ``POSITION_ADAPTERS``): a pre-hook hands it the call context, and its
    adapter looks up the call's global position ids there (``CallContext.positions``). transformers
    declines to switch these families' attention implementation (its source holds attention classes that do not
    use the interface), so their config keeps its own: the adapters never read it, and its mask, built for the
    shard, is ignored; unsharded, the class's own forward runs with the masks of its own implementation.
    BLOOM's and MPT's rows (``OwnAttention.alibi``) hand seqpar's attention their ALiBi slopes (``ALIBI_KEY``),
    made by the family's own function, and ignore the bias their decoder built over the shard (Note [ALiBi]).
    ZAYA's attention calls the interface, but its q/k/v projection (``ZayaCCAProjection``) convolves q and k
    over time and shifts half of v by one token, which on a shard would miss the tokens before each chunk: its
    row's ``forward`` makes q, k and v with the halo exchange (Note [CCA halo]) and attends as the others do;
    transformers does switch ZAYA's implementation, which no code of the adapted module reads. Llama 4's attention
    calls the interface too, but scales its NoPE layers' queries by their positions (Note [Llama 4 temperature]).

Note [Llama 4 temperature]
    Llama 4's NoPE layers multiply each query by ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``, where
    ``i`` counts the call's tokens from 0 (its own ``arange``, not the position ids: in one process a packed
    row's later documents take their index in the row). On a shard that count would restart at every rank, so
    its row's ``forward`` takes ``i`` as each local token's global index under the call's layout; the rest is
    the class's own forward (rotary and the weightless q/k norm on its RoPE layers).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.models import ModelAnatomy
from seqpar.models.own_attention import own_attention, own_attention_class, own_positions_class
from seqpar.sequence_parallel.call_context import CONTEXT_KEY
from seqpar.sequence_parallel.layouts.chunks import position_ids
from seqpar.sequence_parallel.mixers.cca import cca_projection

__all__ = [
    "ADAPTERS",
    "ALIBI_KEY",
    "POSITION_ADAPTERS",
    "AttentionAdapter",
    "adapt_attention",
    "adapted_only",
    "cross_attention",
    "position_tables",
    "unfit_attention",
]

_ATTEND = "_seqpar_attend"  # the adapter class's attribute holding seqpar's attention function
_MISSING = object()
ALIBI_KEY = "seqpar_alibi_slopes"
"""The keyword under which an adapter hands seqpar's attention its ``[H]`` ALiBi slopes (Note [ALiBi])."""


@dataclass(frozen=True)
class AttentionAdapter:
    """seqpar's adapter of one attention class that computes its softmax itself, or of a position table that counts
    a call's tokens itself (Note [attention adapters])."""

    forward: Callable[..., object]
    """The ``forward`` run inside a prepared model's call: the module and its call's arguments, the call context
    among the keywords."""
    reads: tuple[str, ...]
    """The module's attributes (dotted paths) that ``forward`` reads: one missing is refused by ``prepare_model``."""
    functions: tuple[str, ...] = ()
    """Functions of the class's own transformers module that ``forward`` calls (checked likewise)."""


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, S, H*D]`` -> ``[B, H, S, D]``."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attend(
    module: torch.nn.Module,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kwargs: dict,
    scale: float,
    dropout: torch.nn.Module | float,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, H, S/P, D]`` q, k, v through seqpar's attention (with ``slopes``, ALiBi: Note [ALiBi]);
    ``[B, S/P, H*D]`` out."""
    p = dropout.p if isinstance(dropout, torch.nn.Module) else float(dropout)
    biased = {} if slopes is None else {ALIBI_KEY: slopes}
    out, _ = getattr(module, _ATTEND)(
        module,
        *qkv,
        None,  # seqpar's mask is the call context's (Note [transformers integration])
        scaling=scale,
        dropout=p if module.training else 0.0,  # seqpar's attention refuses dropout by name
        sliding_window=window,
        **{CONTEXT_KEY: kwargs[CONTEXT_KEY]},
        **biased,
    )
    return out.flatten(2)


def _refuse_state(module: torch.nn.Module, cache: object, output_attentions: object, kwargs: dict) -> None:
    """What a sharded call cannot serve: a KV cache, attention weights (seqpar never forms them)."""
    name = type(module).__name__
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise SeqparInputError(f"a seqpar-adapted {name} runs inside a prepared model's call, without a cache")
    if output_attentions:
        raise SeqparInputError(f"a seqpar-adapted {name} forms no attention weights: call it without output_attentions")


def _gpt_neo(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    layer_past: object = None,
    attention_mask: object = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """GPTNeoAttention: its inner module's projections, no 1/sqrt(d) scaling, a window on its local layers."""
    _refuse_state(self, layer_past, output_attentions, kwargs)
    inner = self.attention
    qkv = tuple(_heads(proj(hidden_states), inner.num_heads) for proj in (inner.q_proj, inner.k_proj, inner.v_proj))
    # GPT-Neo's local layers see the window_size keys up to and including the query (Mistral's convention)
    window = inner.config.window_size if self.attention_type == "local" else None
    out = _attend(self, qkv, kwargs, 1.0, inner.attn_dropout, window)
    return inner.resid_dropout(inner.out_proj(out)), None


def _openai_gpt(
    self: torch.nn.Module,
    x: torch.Tensor,
    attention_mask: object = None,
    output_attentions: bool = False,
    **kwargs: object,
) -> list[torch.Tensor]:
    """OpenAI GPT's Attention: one fused Conv1D for q, k, v; scaled by 1/sqrt(d) only where its ``scale`` flag says."""
    _refuse_state(self, None, output_attentions, kwargs)
    qkv = tuple(_heads(t, self.n_head) for t in self.c_attn(x).split(self.split_size, dim=2))
    scale = qkv[0].shape[-1] ** -0.5 if self.scale else 1.0
    out = _attend(self, qkv, kwargs, scale, self.attn_dropout)
    return [self.resid_dropout(self.c_proj(out))]  # the class returns a list: [output, (weights)]


def _bart_style(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    key_value_states: torch.Tensor | None = None,
    cache: object = None,
    attention_mask: object = None,
    output_attentions: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """XGLM's and TrOCR's attention (BART's): q, k, v projections with biases, scaled by ``scaling``."""
    if key_value_states is not None:
        raise SeqparInputError(
            f"{type(self).__name__} was handed encoder states (cross-attention): seqpar serves this family's decoder "
            "on its own, without encoder states (Note [attention adapters])"
        )
    _refuse_state(self, cache, output_attentions, kwargs)
    # the query scaled before its product with the keys, as the class does (the same rounding as one process)
    query = _heads(self.q_proj(hidden_states) * self.scaling, self.num_heads)
    qkv = (
        query,
        _heads(self.k_proj(hidden_states), self.num_heads),
        _heads(self.v_proj(hidden_states), self.num_heads),
    )
    out = _attend(self, qkv, kwargs, 1.0, self.dropout)
    return self.out_proj(out), None


def _gpt_neox_japanese(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: object = None,
    position_ids: torch.Tensor | None = None,
    layer_past: object = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """GPT-NeoX-Japanese: a fused q, k, v projection per head, partial rotary, and its dense bias returned apart."""
    _refuse_state(self, layer_past, output_attentions, kwargs)
    if position_embeddings is None:
        raise SeqparInputError(f"{type(self).__name__} needs the model's rotary cos/sin (position_embeddings)")
    fused = _heads(self.query_key_value(hidden_states), self.num_attention_heads)  # [B, H, S, 3 * D] per head
    query, key, value = fused.split(self.head_size, dim=-1)
    rotate = sys.modules[own_attention_class(self).__module__].apply_rotary_pos_emb
    n = self.rotary_ndims  # RoPE on the first n dimensions of each head, the rest pass through
    query_rot, key_rot = rotate(query[..., :n], key[..., :n], *position_embeddings)
    query, key = torch.cat((query_rot, query[..., n:]), dim=-1), torch.cat((key_rot, key[..., n:]), dim=-1)
    out = _attend(self, (query, key, value), kwargs, 1.0 / self.norm_factor, self.attention_dropout)
    return self.dense(out), None, self.dense_bias  # the layer adds the bias (the last layer's) to the residual


def _zaya(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: object = None,
    cache: object = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """ZayaAttention: its CCA projection with the halo exchange (Note [CCA halo]), its q/k norm, partial rotary, and
    a window on its sliding layers. Its mask mapping is ignored: seqpar's calls carry no padding mask."""
    _refuse_state(self, cache, kwargs.get("output_attentions"), kwargs)
    if position_embeddings is None:
        raise SeqparInputError(f"{type(self).__name__} needs the model's rotary cos/sin (position_embeddings)")
    query, key, value = cca_projection(self.qkv_proj, hidden_states, kwargs[CONTEXT_KEY])
    query, key = self.qk_norm(query, key)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    rotate = sys.modules[own_attention_class(self).__module__].apply_rotary_pos_emb
    query, key = rotate(query, key, *position_embeddings)
    out = _attend(self, (query, key, value), kwargs, self.scaling, self.attention_dropout, self.sliding_window)
    return self.o_proj(out), None


def _family(module: torch.nn.Module) -> object:
    """The transformers module that defines the module's row class (its helper functions: a row's ``functions``)."""
    return sys.modules[own_attention_class(module).__module__]


def _llama4(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: torch.Tensor | None = None,
    attention_mask: object = None,
    cache: object = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Llama4TextAttention: rotary and the weightless q/k norm on its RoPE layers; on its NoPE layers the query
    temperature (Note [Llama 4 temperature]) from each token's global index. Its chunked layers' mask comes from
    seqpar's attention (Note [chunked attention])."""
    _refuse_state(self, cache, kwargs.get("output_attentions"), kwargs)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query, key = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    if self.use_rope:  # the model hands every layer its rotary frequencies
        query, key = _family(self).apply_rotary_emb(query, key, position_embeddings.to(query.device))
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        ctx = kwargs[CONTEXT_KEY]
        index = position_ids(shape[1] * ctx.mesh.sp_size, ctx.mesh, ctx.layout, device=query.device).float()
        scales = torch.log1p(torch.floor((index + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, -1, 1, 1)).to(query.dtype)
    qkv = (query.transpose(1, 2), key.transpose(1, 2), value)
    return self.o_proj(_attend(self, qkv, kwargs, self.scaling, self.attention_dropout)), None


def _bloom(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: object = None,
    attention_mask: object = None,
    layer_past: object = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """BloomAttention: a fused q, k, v per head, its ALiBi slopes (the decoder's bias, made over the shard, is not
    read: Note [ALiBi]), and the residual added inside, as the class does."""
    _refuse_state(self, layer_past, output_attentions, kwargs)
    family = _family(self)
    slopes = family._get_alibi_slopes(self.num_heads, hidden_states.device)
    out = _attend(self, self._reshape(self.query_key_value(hidden_states)), kwargs, self.inv_norm_factor,
                  self.attention_dropout, slopes=slopes)  # fmt: skip
    if self.pretraining_tp > 1 and self.slow_but_exact:  # the class's slices of the projection (no bias there)
        width, dense = self.hidden_size / self.pretraining_tp, torch.zeros_like(out)
        for i in range(self.pretraining_tp):
            cols = slice(int(i * width), int((i + 1) * width))
            dense = dense + torch.nn.functional.linear(out[:, :, cols], self.dense.weight[:, cols])
    else:
        dense = self.dense(out)
    return family.dropout_add(dense, residual, self.hidden_dropout, self.training), None


def _mpt_slopes(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """MPT's slopes as its model makes them (``build_mpt_alibi_tensor`` with its default ``alibi_bias_max``, as
    ``MptModel`` calls it): the bias of key 1 less that of key 0."""
    bias = _family(module).build_mpt_alibi_tensor(module.n_heads, 2, device=device)  # [H, 1, 2]
    return (bias[:, 0, 1] - bias[:, 0, 0]).float()


def _mpt(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_bias: object = None,
    cache: object = None,
    attention_mask: object = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """MptAttention: one fused projection, clamped by ``clip_qkv``; its ALiBi slopes (the decoder's bias is not
    read: Note [ALiBi]); its ``softmax_scale``."""
    _refuse_state(self, cache, kwargs.get("output_attentions"), kwargs)
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    qkv = tuple(_heads(t, self.n_heads) for t in mixed.chunk(3, dim=2))
    out = _attend(self, qkv, kwargs, self.softmax_scale, self.attn_dropout_p, slopes=_mpt_slopes(self, mixed.device))
    return self.out_proj(out), None


_BART_STYLE = AttentionAdapter(
    _bart_style, ("q_proj", "k_proj", "v_proj", "out_proj", "num_heads", "scaling", "dropout")
)
ADAPTERS = {
    "GPTNeoAttention": AttentionAdapter(
        _gpt_neo,
        (
            *("attention_type", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.out_proj"),
            *("attention.num_heads", "attention.config.window_size", "attention.attn_dropout"),
            "attention.resid_dropout",
        ),
    ),
    "Attention": AttentionAdapter(
        _openai_gpt, ("c_attn", "c_proj", "n_head", "split_size", "scale", "attn_dropout", "resid_dropout")
    ),
    "XGLMAttention": _BART_STYLE,
    "TrOCRAttention": _BART_STYLE,
    "GPTNeoXJapaneseAttention": AttentionAdapter(
        _gpt_neox_japanese,
        (
            *("query_key_value", "dense", "dense_bias", "num_attention_heads", "head_size", "rotary_ndims"),
            *("norm_factor", "attention_dropout"),
        ),
        ("apply_rotary_pos_emb",),
    ),
    "ZayaAttention": AttentionAdapter(
        _zaya,
        (
            *("qkv_proj.q_proj", "qkv_proj.k_proj", "qkv_proj.v_proj_current", "qkv_proj.v_proj_delayed"),
            *("qkv_proj.conv_qk_depthwise", "qkv_proj.conv_qk_grouped", "qkv_proj.conv_kernel_size"),
            *("qkv_proj.head_dim", "qkv_proj.num_key_value_groups", "qk_norm", "o_proj", "scaling"),
            *("attention_dropout", "sliding_window"),
        ),
        ("apply_rotary_pos_emb",),
    ),
    "BloomAttention": AttentionAdapter(
        _bloom,
        (
            *("query_key_value", "dense", "num_heads", "hidden_size", "inv_norm_factor", "attention_dropout"),
            *("hidden_dropout", "pretraining_tp", "slow_but_exact", "_reshape"),
        ),
        ("_get_alibi_slopes", "dropout_add"),
    ),
    "MptAttention": AttentionAdapter(
        _mpt,
        ("Wqkv", "out_proj", "n_heads", "clip_qkv", "softmax_scale", "attn_dropout_p"),
        ("build_mpt_alibi_tensor",),
    ),
    "Llama4TextAttention": AttentionAdapter(
        _llama4,
        (
            *("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "attention_dropout", "use_rope"),
            *("attn_temperature_tuning", "floor_scale", "attn_scale"),
        ),
        ("apply_rotary_emb",),
    ),
}
"""Attention class name (an ``OWN_ATTENTION`` row) -> its adapter."""


def _learned_positions(
    self: torch.nn.Module, input_ids: torch.Tensor, cache_length: int = 0, position_ids: object = None, **kwargs: object
) -> torch.Tensor:
    """TrOCR's learned position table: the call's global position ids, offset as the class offsets its own count."""
    positions = kwargs[CONTEXT_KEY].positions
    if cache_length or positions is None:
        raise SeqparInputError(f"a seqpar-adapted {type(self).__name__} needs the call's position_ids and no cache")
    return torch.nn.Embedding.forward(self, positions.to(self.weight.device) + self.offset)


POSITION_ADAPTERS = {"TrOCRLearnedPositionalEmbedding": AttentionAdapter(_learned_positions, ("offset", "weight"))}
"""Position table class name (an ``OWN_POSITIONS`` row) -> its adapter."""


def _row(name: str) -> AttentionAdapter | None:
    return ADAPTERS.get(name) or POSITION_ADAPTERS.get(name)


def _row_class(module: torch.nn.Module) -> type | None:
    return own_attention_class(module) or own_positions_class(module)


@functools.cache
def _adapter_class(cls: type, attend: Callable[..., object]) -> type:
    """The adapter subclass of ``cls`` (made once per class, so every prepared model shares it)."""

    def forward(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        if kwargs.get(CONTEXT_KEY) is None:  # unsharded, or called alone (Note [attention adapters])
            return cls.forward(self, *args, **kwargs)
        return _row(cls.__name__).forward(self, *args, **kwargs)  # the row answers at each call

    namespace = {"forward": forward, _ATTEND: staticmethod(attend), "__module__": __name__}
    return type(f"Seqpar{cls.__name__}", (cls,), namespace)


def cross_attention(served: ModelAnatomy) -> list[torch.nn.Module]:
    """The layers' cross-attention modules of adapted classes (the rows' ``cross`` names), unused without encoder
    states: adapted and hooked like the attention, so that encoder states are refused (Note [attention adapters])."""
    found = []
    for layer in served.layers:
        for name, child in layer.named_children():
            row = own_attention(child)
            if row is not None and name in row.cross:
                found.append(child)
    return found


def position_tables(served: ModelAnatomy) -> list[torch.nn.Module]:
    """The decoder's position tables that have an adapter row: handed the call's context by a hook, as their decoder
    does not pass it (Note [attention adapters])."""
    return [child for child in served.decoder.children() if own_positions_class(child) is not None]


def _lacks(module: torch.nn.Module, row: AttentionAdapter) -> list[str]:
    """What of the row's reads and functions ``module`` lacks (an attribute that is None is there: GPT-NeoX-Japanese's
    dense bias outside its last layer)."""
    lacks = []
    for path in row.reads:
        found: object = module
        for part in path.split("."):
            found = getattr(found, part, _MISSING)
        if found is _MISSING:
            lacks.append(path)
    source = sys.modules.get(_row_class(module).__module__)
    return lacks + [f"{source.__name__}.{f}" for f in row.functions if not callable(getattr(source, f, None))]


def unfit_attention(served: ModelAnatomy) -> list[str]:
    """Why the model's own-code attention classes cannot be adapted: one line per class without an adapter or
    lacking what its adapter reads (Note [attention adapters]); empty when every one fits."""
    import transformers

    found: dict[str, str] = {}
    for module in (*filter(None, served.attention), *cross_attention(served), *position_tables(served)):
        cls = _row_class(module)
        if cls is None or cls.__name__ in found:
            continue
        row = _row(cls.__name__)
        if row is None:
            what = "counts its tokens' positions" if own_positions_class(module) else "computes its attention"
            found[cls.__name__] = (
                f"{cls.__name__} {what} in its own code and seqpar has no adapter for it (seqpar adapts "
                f"{', '.join(sorted(ADAPTERS | POSITION_ADAPTERS))})"
            )
        elif lacks := _lacks(module, row):
            found[cls.__name__] = (
                f"{cls.__name__} lacks {', '.join(lacks)}, which seqpar's adapter reads (transformers "
                f"{transformers.__version__}; the adapters follow the classes of the versions seqpar declares)"
            )
    return [found[name] for name in sorted(found)]


def adapted_only(served: ModelAnatomy) -> bool:
    """Every attention module of the model runs an adapter, so none reads the config's attention implementation
    (transformers declines to switch such a family's: Note [attention adapters])."""
    attention = [m for m in served.attention if m is not None]
    return bool(attention) and all(own_attention_class(m) is not None for m in attention)


def adapt_attention(served: ModelAnatomy, attend: Callable[..., object]) -> None:
    """Swap the class of each own-code attention module, cross-attention and position table for its adapter, in
    place (adapted ones are left as they are).

    Args:
        served: the model's anatomy; ``unfit_attention`` is empty for it.
        attend: seqpar's attention function (transformers' signature), which the adapters call.
    """
    for module in (*filter(None, served.attention), *cross_attention(served), *position_tables(served)):
        cls = _row_class(module)
        if cls is not None and type(module) is cls and _row(cls.__name__) is not None:
            module.__class__ = _adapter_class(cls, attend)
