"""Attention classes that compute their softmax (or mix tokens before it) in their own code, and position tables that
count tokens themselves.

The anatomy reader (Note [read anatomy]) counts them as served; their adapters live in
``seqpar.sequence_parallel.attention_adapters`` (Note [attention adapters]), keyed by the same class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.models.layer_masks import LayerMask, layer_mask

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch import nn


@dataclass(frozen=True)
class OwnAttention:
    """What the anatomy reader knows of one attention class that does not call transformers' attention functions."""

    module: str
    """The transformers module that defines the class: a class of the same name elsewhere is another class."""
    inner: tuple[str, ...] = ()
    """Children that hold the projections the adapter reads (GPT-Neo's wrapper keeps them in ``attention``): not a
    nested block of the reader's sense (a sparse-attention indexer)."""
    cross: tuple[str, ...] = ()
    """The names under which a decoder layer holds the class as cross-attention over an encoder's states. Over
    whole encoder states it acts on each decoder token alone, so the reader declares it per token; its adapter
    refuses encoder states inside a sharded call."""
    alibi: bool = False
    """Its adapter hands seqpar's attention the family's ALiBi slopes (Note [ALiBi] in
    ``seqpar.sequence_parallel.kernels.alibi``): the bias its decoder builds in its own code is then served."""


_MODELS = "transformers.models"
OWN_ATTENTION = {
    "GPTNeoAttention": OwnAttention(f"{_MODELS}.gpt_neo.modeling_gpt_neo", inner=("attention",)),
    "Attention": OwnAttention(f"{_MODELS}.openai.modeling_openai"),
    "XGLMAttention": OwnAttention(f"{_MODELS}.xglm.modeling_xglm", cross=("encoder_attn",)),
    "TrOCRAttention": OwnAttention(f"{_MODELS}.trocr.modeling_trocr", cross=("encoder_attn",)),
    "GPTNeoXJapaneseAttention": OwnAttention(f"{_MODELS}.gpt_neox_japanese.modeling_gpt_neox_japanese"),
    "BloomAttention": OwnAttention(f"{_MODELS}.bloom.modeling_bloom", alibi=True),
    "MptAttention": OwnAttention(f"{_MODELS}.mpt.modeling_mpt", alibi=True),
    # ZAYA's attention goes through the interface, but its q/k/v projection mixes neighbouring tokens (Note [CCA halo])
    "ZayaAttention": OwnAttention(f"{_MODELS}.zaya.modeling_zaya", inner=("qkv_proj",)),
    # Llama 4's attention goes through the interface, but scales its NoPE layers' queries by position (Note [Llama 4
    # temperature])
    "Llama4TextAttention": OwnAttention(f"{_MODELS}.llama4.modeling_llama4"),
}
"""Attention class name -> its row (Note [attention adapters])."""


@dataclass(frozen=True)
class SparseIndexer:
    """How one indexer class selects keys and hands its picks on (Note [indexed attention])."""

    module: str
    """The transformers module that defines the class."""
    picks: str = "indices"
    """"indices": its attention module hands the attention function the picked key indices (``indices=``, DSA);
    "mask": it returns a boolean mask over the keys, which its attention module joins to its attention mask and
    hands the attention function as that mask (Qwen4-Exp's QSA)."""
    positions: bool = False
    """It rotates keys by the rows of the rotary table it is handed at their global indices (QSA's block keys take
    the row of each block's first token) and its queries by the table's last rows: seqpar hands it the whole row's
    table, gathered, followed by the shard's own rows."""


SPARSE_INDEXERS = {
    "DeepseekV32Indexer": SparseIndexer(f"{_MODELS}.deepseek_v32.modeling_deepseek_v32"),
    "GlmMoeDsaIndexer": SparseIndexer(f"{_MODELS}.glm_moe_dsa.modeling_glm_moe_dsa"),
    "MistralLarge4TextIndexer": SparseIndexer(f"{_MODELS}.mistral_large4.modeling_mistral_large4"),
    "Dots3NoteTextIndexer": SparseIndexer(f"{_MODELS}.dots3_note.modeling_dots3_note"),
    "AXK2Indexer": SparseIndexer(f"{_MODELS}.axk2.modeling_axk2"),
    "HYV4Indexer": SparseIndexer(f"{_MODELS}.hy_v4.modeling_hy_v4"),
    "HYV4VLIndexer": SparseIndexer(f"{_MODELS}.hy_v4_vl.modeling_hy_v4_vl"),
    # QSA: each query ranks the means of blocks of its visible keys, keeps the best blocks and its last partial one
    "Qwen4ExpTextQSAIndexer": SparseIndexer(f"{_MODELS}.qwen4_exp.modeling_qwen4_exp", picks="mask", positions=True),
}
"""Indexers of sparse attention that seqpar serves (Note [indexed attention]), class name -> its row: each takes its
keys from ``cache.update_indexer`` and masks its scores with the mask its attention module hands it."""

_V4 = f"{_MODELS}.deepseek_v4.modeling_deepseek_v4"
KEY_COMPRESSORS = {"DeepseekV4CSACompressor": (_V4, "compress_rate"), "DeepseekV4HCACompressor": (_V4, "compress_rate")}
"""Compressors that pool an attention layer's keys over windows of tokens (DeepSeek-V4's CSA, with its indexer, and
HCA) that seqpar serves (Note [compressed attention]), class name -> (the transformers module that defines it, the
attribute holding its window size): each reads its projections through the cache's ``store_compression_weights``
and returns its pooled keys with what each query may see of them, which its attention module appends to its own."""

OWN_POSITIONS = {"TrOCRLearnedPositionalEmbedding": f"{_MODELS}.trocr.modeling_trocr"}
"""Position tables that count a call's tokens themselves because their decoder does not hand them the position
ids, class name -> the transformers module that defines it: seqpar's adapter gives them the call's global
position ids instead (Note [attention adapters])."""


def own_attention_class(module: nn.Module) -> type | None:
    """The class of ``module`` (or the one seqpar's adapter subclasses) that has an ``OWN_ATTENTION`` row, or None."""
    return _row_class(module, {name: row.module for name, row in OWN_ATTENTION.items()})


def own_positions_class(module: nn.Module) -> type | None:
    """The class of ``module`` (or the one seqpar's adapter subclasses) that has an ``OWN_POSITIONS`` row, or None."""
    return _row_class(module, OWN_POSITIONS)


def _row_class(module: nn.Module, modules: dict[str, str]) -> type | None:
    for cls in type(module).__mro__:
        if modules.get(cls.__name__) == cls.__module__:
            return cls
    return None


def _indexer_class(module: nn.Module) -> type | None:
    return _row_class(module, {name: row.module for name, row in SPARSE_INDEXERS.items()})


def sparse_indexer(attention: nn.Module) -> nn.Module | None:
    """The child of an attention module whose class has a ``SPARSE_INDEXERS`` row, or None."""
    return next((c for c in attention.children() if _indexer_class(c) is not None), None)


def indexer_row(indexer: nn.Module) -> SparseIndexer | None:
    """The ``SPARSE_INDEXERS`` row of an indexer module's class, or None."""
    cls = _indexer_class(indexer)
    return None if cls is None else SPARSE_INDEXERS[cls.__name__]


def key_compressor(attention: nn.Module) -> tuple[nn.Module, str] | None:
    """The child of an attention module whose class has a ``KEY_COMPRESSORS`` row, and its window-size attribute."""
    rows = {name: module for name, (module, _) in KEY_COMPRESSORS.items()}
    child = next((c for c in attention.children() if _row_class(c, rows) is not None), None)
    return None if child is None else (child, KEY_COMPRESSORS[_row_class(child, rows).__name__][1])


def indexed_modules(attention: Iterable[nn.Module | None]) -> set[int]:
    """``id`` of each attention module that attends to an indexer's picks: those with a served indexer of their own,
    and those of an indexed layer type whose class holds one in another layer (a layer that reuses an earlier
    layer's picks: GLM-5's and HY-V4's shared top-k)."""
    present = [m for m in attention if m is not None]
    classes = {type(m) for m in present if sparse_indexer(m) is not None}
    indexed_kind = {id(m) for m in present if (layer_mask(m) or (None, LayerMask()))[1].indexer}
    return {id(m) for m in present if sparse_indexer(m) is not None or (type(m) in classes and id(m) in indexed_kind)}


def own_attention(module: nn.Module) -> OwnAttention | None:
    """The ``OWN_ATTENTION`` row of ``module``'s class, or None."""
    cls = own_attention_class(module)
    return None if cls is None else OWN_ATTENTION[cls.__name__]
