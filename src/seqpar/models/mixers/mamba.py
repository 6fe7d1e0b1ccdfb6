"""The state-space rows: Mamba2 / SSD (Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1, Zamba2, Mamba2) and Mamba1.

Their sizes, parameters, kept elements and state exchange as Note [hybrid sizes] and Note [hybrid memory] count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from seqpar.errors import SeqparInputError
from seqpar.models.mixers.base import Get, MixerSizes, Names


@dataclass(frozen=True)
class Mamba2(MixerSizes):
    """Mamba2 / SSD: heads of ``head_dim``, groups of B and C of ``state`` N, a convolution of K, the kernel's
    ``chunk`` length (Note [hybrid sizes]). ``names`` may add ``expand`` (the config's expansion, from which a
    missing ``head_dim`` is derived) and ``ssm_width`` (a config's SSD width, which must be the heads')."""

    kind = "mamba2"
    label = "Mamba2"
    layer_types = ("mamba", "mamba2")
    adapts = (
        *("GraniteMoeHybridMambaLayer", "BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "Mamba2Mixer"),
        "Zamba2MambaMixer",
    )
    names: ClassVar[Names] = dict(
        heads="mamba_n_heads",
        head_dim="mamba_d_head",
        state="mamba_d_state",
        groups="mamba_n_groups",
        conv_width="mamba_d_conv",
        chunk="mamba_chunk_size",
        conv_bias="mamba_conv_bias",
        proj_bias="mamba_proj_bias",
        expand="mamba_expand",
    )

    heads: int
    head_dim: int
    state: int
    groups: int
    conv_width: int
    chunk: int
    conv_bias: bool = True
    proj_bias: bool = False
    gated_norm: bool = True
    """The gated RMSNorm before ``out_proj`` (Falcon-H1 builds it only with ``mamba_rms_norm``)."""

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        heads = read.get("heads")
        if field == "head_dim" and not value and names.get("expand") and isinstance(heads, int) and heads > 0:
            return (get(names["expand"]) or 2) * hidden // heads  # as the configs derive it
        return value

    @classmethod
    def read(cls, get: Get, names: Names, hidden: int) -> Mamba2:
        sizes = super().read(get, names, hidden)
        width = get(names["ssm_width"]) if names.get("ssm_width") else None
        if width is not None and width != sizes.heads * sizes.head_dim:  # the kernel reshapes it into the heads
            raise SeqparInputError(f"{names['ssm_width']} {width} is not {names['heads']} x {names['head_dim']}")
        return sizes

    def as_config(self, names: Names, hidden: int) -> dict:
        config = super().as_config(names, hidden)
        if names.get("head_dim") is None:  # derived from the expansion
            config[names["expand"]] = self.heads * self.head_dim // hidden
        if names.get("ssm_width"):
            config[names["ssm_width"]] = self.heads * self.head_dim
        return config

    @property
    def inner(self) -> int:
        """``I_m``: the heads' width."""
        return self.heads * self.head_dim

    def params(self, hidden: int) -> int:
        inner, heads = self.inner, self.heads
        conv = inner + 2 * self.groups * self.state
        projected = inner + conv + heads
        bias = (projected + hidden) if self.proj_bias else 0
        conv_params = conv * self.conv_width + (conv if self.conv_bias else 0)
        norm = inner if self.gated_norm else 0
        return hidden * projected + inner * hidden + bias + conv_params + 3 * heads + norm

    def conv(self, hidden: int) -> tuple[int, int]:
        return self.inner + 2 * self.groups * self.state, self.conv_width

    def kernel(self) -> float:
        """``S`` of Note [hybrid memory]: float32 elements per token inside ``mamba2_chunk_scan``."""
        hm, n, c = self.heads, self.state, self.chunk
        return 4 * hm * self.head_dim + 3 * hm * c + 5 * hm * n + 2 * hm * self.head_dim * n / c + 5 * hm

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        inner, hm = self.inner, self.heads
        projected = 2 * inner + 2 * self.groups * self.state + hm
        gated = 5 if self.gated_norm else 2  # the gated norm's tensors, or the plain gate's product
        around = projected + 2 * self.conv(hidden)[0] + gated * inner + 3 * hm
        entering = 0 if sp_size == 1 else hm * self.state + inner + 4 * hm  # C per head, the read, the decays
        return around, self.kernel() + entering

    def exchange(self, rows: int, chunks: int) -> int:  # M: a decay per head, sent alone
        return chunks * rows * self.heads * (1 + self.head_dim * self.state) * 4

    def head_parallel(self, hidden: int) -> int:  # x, B, C and dt in; y back
        return 2 * self.inner + 2 * self.groups * self.state + self.heads


@dataclass(frozen=True)
class Mamba1(MixerSizes):
    """Mamba1: ``inner`` channels of state N, a time-step projection of rank ``dt_rank``, a convolution of K
    (Note [hybrid sizes]). ``names`` may add ``expand``, from which an ``inner`` named None is derived."""

    kind = "mamba1"
    label = "Mamba1"
    layer_types = ("mamba",)
    adapts = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer")
    names: ClassVar[Names] = dict(
        inner=None,
        expand="mamba_expand",
        state="mamba_d_state",
        conv_width="mamba_d_conv",
        dt_rank="mamba_dt_rank",
        conv_bias="mamba_conv_bias",
        proj_bias="mamba_proj_bias",
    )

    inner: int
    state: int
    conv_width: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_norms: bool = False
    """RMSNorms on dt, B and C (Falcon-Mamba's weightless, Jamba's weighted)."""
    dt_norm_weights: bool = False
    """Those norms have weights (Jamba)."""
    scan_block: ClassVar[int] = 128
    """Tokens per recomputed block of seqpar's scan (Note [Mamba1 state]): a ``D x N`` state kept per block,
    one block's steps alive in the backward."""

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        if field == "inner" and names.get("inner") is None:
            return (get(names["expand"]) or 2) * hidden
        if field == "dt_rank" and value == "auto":  # as the configs derive it
            return -(-hidden // 16)
        return value

    def as_config(self, names: Names, hidden: int) -> dict:
        config = super().as_config(names, hidden)
        if names.get("inner") is None:
            config[names["expand"]] = self.inner // hidden
        return config

    def params(self, hidden: int) -> int:  # in_proj, conv, x_proj, dt_proj (biased), A_log, D, out_proj
        inner, n, rank = self.inner, self.state, self.dt_rank
        bias = 2 * inner + hidden if self.proj_bias else 0
        conv = inner * self.conv_width + (inner if self.conv_bias else 0)
        scan = inner * (rank + 2 * n) + rank * inner + inner + inner * n + inner
        norms = rank + 2 * n if self.dt_norm_weights else 0
        return 2 * hidden * inner + conv + scan + inner * hidden + bias + norms

    def conv(self, hidden: int) -> tuple[int, int]:
        return self.inner, self.conv_width

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:  # Note [Mamba1 state]: blocks recomputed
        inner, n, low = self.inner, self.state, self.dt_rank + 2 * self.state
        around = 6 * inner + low + (low + 3 if self.dt_norms else 0)
        scan = 3 * inner + inner * n / self.scan_block  # dt and its float32 copies; a state per block
        entering = 0 if sp_size == 1 else inner  # the steps' running sum, read back per block
        return around, scan + entering

    def exchange(self, rows: int, chunks: int) -> int:  # Note [Mamba1 state]: a 1 x 1 state per channel and entry
        return chunks * rows * self.inner * self.state * 1 * (1 + 1) * 4

    def head_parallel(self, hidden: int) -> int:  # channels split: x and dt in, B and C whole, y back
        return 3 * self.inner + 2 * self.state
