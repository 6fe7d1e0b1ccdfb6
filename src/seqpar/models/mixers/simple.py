"""The rows without a state-space scan's sizes: LFM2's gated short convolution and MiniMax's lightning attention.

Their sizes, parameters, kept elements and state exchange as Note [hybrid sizes] and Note [hybrid memory] count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpar.models.mixers.base import Get, MixerSizes, Names


@dataclass(frozen=True)
class ShortConv(MixerSizes):
    """LFM2's gated short convolution of width K over the hidden channels (Note [hybrid sizes])."""

    kind = "short_conv"
    label = "short convolution"
    layer_types = ("conv",)
    adapts = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
    names: ClassVar[Names] = dict(conv_width="conv_L_cache", bias="conv_bias")

    conv_width: int
    bias: bool = False
    """Its projections and convolution have biases."""

    def params(self, hidden: int) -> int:  # in_proj 3 H^2, the convolution H K, out_proj H^2
        return 4 * hidden * hidden + hidden * self.conv_width + (5 * hidden if self.bias else 0)

    def conv(self, hidden: int) -> tuple[int, int]:
        return hidden, self.conv_width

    def elements(
        self, hidden: int, sp_size: int
    ) -> tuple[int, float]:  # in_proj's output, the convolution's, out_proj's
        return 5 * hidden, 0.0

    def head_parallel(self, hidden: int) -> int:  # the gated input's channels in, the convolution's output back
        return 2 * hidden


@dataclass(frozen=True)
class Lightning(MixerSizes):
    """MiniMax's lightning attention: ``heads`` of ``head_dim``, run in blocks of ``block`` tokens (Note [lightning
    blocks])."""

    kind = "lightning"
    label = "lightning attention"
    adapts = ("MiniMaxLightningAttention",)
    names: ClassVar[Names] = dict(heads="num_attention_heads", head_dim="head_dim", block="block_size")

    heads: int
    head_dim: int
    block: int

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        heads = read.get("heads")
        if field == "head_dim" and not value and isinstance(heads, int) and heads > 0:
            return hidden // heads
        return value

    def params(self, hidden: int) -> int:  # qkv_proj, out_proj and output_gate over H = heads x head_dim, its RMSNorm
        return 5 * hidden * hidden + hidden

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        # per block of b tokens: k^T, q, the decayed scores, the state (Note [hybrid memory])
        heads, dim, block = self.heads, self.head_dim, self.block
        kernel = heads * (2 * dim + block + dim * dim / block)
        reads = 0 if sp_size == 1 else heads * dim  # the decayed queries that read the entering state
        return 12 * hidden + 1, kernel + reads

    def exchange(self, rows: int, chunks: int) -> int:  # Note [lightning blocks]: M is a decay times the identity
        return chunks * rows * self.heads * (1 + self.head_dim * self.head_dim) * 4

    def head_parallel(self, hidden: int) -> int:  # q, k and v in; the output back
        return 4 * self.heads * self.head_dim


@dataclass(frozen=True)
class NGramEmbedding(MixerSizes):
    """Qwen4-Exp's per-layer n-gram embeddings (Note [n-gram halo]): each token's ``ngram_size`` ids hashed into
    ``embed_dim`` values, gating ``streams`` residual streams, then a convolution of ``conv_width`` taps
    ``ngram_size`` tokens apart over the streams."""

    kind = "ngram_embedding"
    label = "n-gram embedding"
    adapts = ("Qwen4ExpTextPLELayer",)
    names: ClassVar[Names] = dict(
        ngram_size="ngram_size", embed_dim="ple_embed_dim", conv_width="ple_conv_kernel_size", streams="hc_count"
    )

    ngram_size: int
    embed_dim: int
    conv_width: int
    streams: int

    def params(self, hidden: int) -> int:  # key and value projections, three norms, the convolution (not the tables,
        # whose rows are primes above ngram_vocab_size_base: the embedding's own count)
        wide = self.streams * hidden
        return self.embed_dim * (wide + hidden) + 3 * wide + wide * self.conv_width

    def conv(self, hidden: int) -> tuple[int, int]:  # the dilated taps as one causal kernel, zeros between them
        return self.streams * hidden, (self.conv_width - 1) * self.ngram_size + 1

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:  # embeddings, keys, value, gated, normed,
        # convolved streams
        wide = self.streams * hidden
        return self.embed_dim + 4 * wide + hidden, 0.0

    def head_parallel(self, hidden: int) -> int:  # the normed streams in, the convolved ones back
        return 2 * self.streams * hidden
