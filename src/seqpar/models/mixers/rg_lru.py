"""The RG-LRU row: RecurrentGemma's recurrent block (Griffin's real-gated linear recurrent unit and its convolution).

Its sizes, parameters, kept elements and state exchange, as the other rows count theirs (Note [mixer rows]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpar.models.mixers.base import Get, MixerSizes, Names


@dataclass(frozen=True)
class RgLru(MixerSizes):
    """RecurrentGemma's recurrent block: ``width`` channels (``lru_width``, the hidden size where unset), its gates
    block-diagonal over ``heads`` blocks, a causal convolution of ``conv_width`` (Note [RG-LRU state])."""

    kind = "rg_lru"
    label = "RG-LRU"
    adapts = ("RecurrentGemmaRecurrentBlock",)
    names: ClassVar[Names] = dict(width="lru_width", heads="num_attention_heads", conv_width="conv1d_width")

    width: int
    heads: int
    conv_width: int

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        if field == "width" and value is None:  # as the config derives it
            return hidden
        return value

    def params(self, hidden: int) -> int:
        # linear_y and linear_x H W + W each, linear_out W H + H, the convolution W K + W, the recurrence's
        # recurrent_param W and its two block-diagonal gates (W^2 / heads + W each)
        w = self.width
        return 3 * hidden * w + hidden + w * self.conv_width + 6 * w + 2 * w * w // self.heads

    def conv(self, hidden: int) -> tuple[int, int]:
        return self.width, self.conv_width

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        # the two branches' projections and the gelu, the convolution's output, the gates and the decay's terms,
        # the gated input and its multiplier, the read and the product; the scan keeps each step's decay and
        # state in float32, and where a state enters a piece, the decays' running product (cumprod's in and out)
        entering = 0 if sp_size == 1 else 2 * self.width
        return 14 * self.width, 2.0 * self.width + entering

    def exchange(self, rows: int, chunks: int) -> int:  # Note [RG-LRU state]: a 1 x 1 state per channel
        return chunks * rows * self.width * (1 + 1) * 4

    def head_parallel(self, hidden: int) -> int:  # channels split: the decays and the drive in, the states back
        return 3 * self.width
