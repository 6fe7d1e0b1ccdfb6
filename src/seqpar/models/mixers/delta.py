"""The delta-rule rows: gated DeltaNet (Qwen3-Next, Qwen3.5, Olmo-Hybrid) and KDA (Kimi Linear).

Their sizes, parameters, kept elements and state exchange as Note [hybrid sizes] and Note [hybrid memory] count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpar.models.mixers.base import MixerSizes, Names

GDN_CHUNK = 64
"""``torch_chunk_gated_delta_rule``'s default chunk length, the one seqpar's adapters run it with."""


@dataclass(frozen=True)
class GatedDeltaNet(MixerSizes):
    """Gated DeltaNet: Hk key heads of dk, Hv value heads of dv, a short convolution of K (Note [hybrid sizes])."""

    kind = "gated_deltanet"
    label = "gated DeltaNet"
    adapts = (
        *("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet"),
        *("LaraMiniGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet"),
    )
    names: ClassVar[Names] = dict(
        key_heads="linear_num_key_heads",
        value_heads="linear_num_value_heads",
        key_head_dim="linear_key_head_dim",
        value_head_dim="linear_value_head_dim",
        conv_width="linear_conv_kernel_dim",
    )

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int

    def params(self, hidden: int) -> int:
        keys, values = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        heads = self.value_heads
        projections = hidden * (2 * keys + 2 * values + 2 * heads) + values * hidden
        conv = (2 * keys + values) * self.conv_width
        return projections + conv + 2 * heads + self.value_head_dim

    def conv(self, hidden: int) -> tuple[int, int]:
        keys = self.key_heads * self.key_head_dim
        return 2 * keys + self.value_heads * self.value_head_dim, self.conv_width

    def kernel(self, dv: int) -> float:
        """``G(dv)`` of Note [hybrid memory]: float32 elements per token inside the gated delta rule's kernel."""
        hv, dk, c = self.value_heads, self.key_head_dim, GDN_CHUNK
        return 5 * hv * c + 12 * hv * dk + 3 * hv * dv + 7 * hv + hv * dk * dv / c

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        heads, dk, dv = self.value_heads, self.key_head_dim, self.value_head_dim
        around = self.conv(hidden)[0] + 6 * heads * dv + 3 * heads
        # sp > 1: the opening run is dv + dk wide, and its reads of the identity stay for the state's term
        return around, self.kernel(dv) if sp_size == 1 else self.kernel(dv + dk) + heads * dk

    def exchange(self, rows: int, chunks: int) -> int:
        dk, dv = self.key_head_dim, self.value_head_dim
        return chunks * rows * self.value_heads * dk * (dk + dv) * 4

    def head_parallel(self, hidden: int) -> int:  # q, k, v, beta and the decay in; the output back
        keys = self.key_heads * self.key_head_dim
        return 2 * keys + 2 * self.value_heads * self.value_head_dim + 2 * self.value_heads


@dataclass(frozen=True)
class Kda(MixerSizes):
    """KDA (Kimi Linear): h heads of d = dk = dv, the decay a vector per key channel (Note [hybrid sizes])."""

    kind = "kda"
    label = "KDA"
    adapts = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention")
    names: ClassVar[Names] = dict(
        heads="linear_num_heads", head_dim="linear_head_dim", conv_width="linear_conv_kernel_dim"
    )

    heads: int
    head_dim: int
    conv_width: int

    def params(self, hidden: int) -> int:
        # q, k, v, their convolution, the low-rank decay and gate, beta, A_log, o_norm, o_proj
        heads, width = self.heads, self.head_dim
        inner = heads * width
        gates = 2 * (hidden * width + width * inner) + inner + heads  # f_a, f_b, g_a, g_b, dt_bias, A_log
        return 4 * hidden * inner + 3 * inner * self.conv_width + gates + hidden * heads + width

    def conv(self, hidden: int) -> tuple[int, int]:  # its q, k and v
        return 3 * self.heads * self.head_dim, self.conv_width

    def kernel(self, dv: int) -> float:
        """``K(dv)`` of Note [hybrid memory]: float32 elements per token inside ``chunk_kimi_delta_attention``."""
        dk, c = self.head_dim, GDN_CHUNK
        per_head = c * c / 3 + 2 * c + dk * (3 * c + 12) + 3 * dv + 7 + dk * dv / c
        return self.heads * per_head

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        heads, d = self.heads, self.head_dim
        around = self.conv(hidden)[0] + 6 * heads * d + 3 * heads
        return around, self.kernel(d) if sp_size == 1 else self.kernel(d + d) + heads * d

    def exchange(self, rows: int, chunks: int) -> int:
        d = self.head_dim
        return chunks * rows * self.heads * d * (d + d) * 4

    def head_parallel(self, hidden: int) -> int:  # q, k, v, the decay per channel and beta in; the output back
        return 5 * self.heads * self.head_dim + self.heads
