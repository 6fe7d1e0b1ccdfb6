"""The RWKV row: RWKV-4's time mixing (the WKV recurrence) and channel mixing, each shifting tokens by one.

Its sizes, parameters, kept elements and state exchange, as the other rows count theirs (Note [mixer rows]). No
family's ``hybrid`` names it yet: the memory estimate refuses RWKV by name (its layers hold no attention or MLP
as ``ModelSizes`` counts them), and the row stands for the adapters (Note [WKV state]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpar.models.mixers.base import Get, MixerSizes, Names


@dataclass(frozen=True)
class Rwkv(MixerSizes):
    """RWKV-4's block: time mixing over ``width`` channels (``attention_hidden_size``, the hidden size where unset)
    and channel mixing through ``intermediate`` (4 H where unset), each with a token shift (a halo of one token)."""

    kind = "rwkv"
    label = "RWKV"
    adapts = ("RwkvSelfAttention", "RwkvFeedForward")
    names: ClassVar[Names] = dict(width="attention_hidden_size", intermediate="intermediate_size")

    width: int
    intermediate: int

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        if value is None:  # as the layers derive them
            return hidden if field == "width" else 4 * hidden
        return value

    def params(self, hidden: int) -> int:
        # time mixing: time_decay and time_first (W each), three mixing weights (H each), key, value and receptance
        # (H W each) and output (W H); channel mixing: two mixing weights, key (H I), receptance (H^2), value (I H)
        w, i = self.width, self.intermediate
        return 2 * w + 3 * hidden + 4 * hidden * w + 2 * hidden + 2 * hidden * i + hidden * hidden

    def conv(self, hidden: int) -> tuple[int, int]:  # the token shifts: a width-2 "convolution" of each mixer
        return 2 * hidden, 2

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        # the shifted inputs and the mixed ones, key, value, receptance and its sigmoid, the read and the product;
        # the channel mixing's mixed inputs, key and its square, receptance; the WKV loop keeps per token its
        # read (3 W) and state (3 W) in float32
        w, i = self.width, self.intermediate
        return 2 * hidden + 3 * hidden + 6 * w + 2 * hidden + 2 * i + 2 * hidden, 6.0 * w

    def exchange(self, rows: int, chunks: int) -> int:  # Note [WKV state]: a 1 x 2 state per channel and its decay
        return chunks * rows * self.width * (1 + 2) * 4

    def head_parallel(self, hidden: int) -> int:  # channels split: key and value in, the read back
        return 3 * self.width
