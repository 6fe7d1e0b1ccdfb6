"""The vision tower's share of one rank's step memory: its parameters and what its patches keep for the backward.

``estimate_memory(..., vision_patches=N)`` adds it to the decoder's estimate (Note [vision tower memory]).

Note [vision tower memory]
    Notation: d the tower's width, I its MLP width, h its heads, hd = d / h, D its depth, C x T x p x p the
    pixels of one patch (channels, temporal patch, patch side), m = spatial_merge_size^2 patches per merged
    token, O the decoder's width, N the sample's patches (``sum(t x h x w)`` of its grids), P the sp degree.
    A rank runs the tower on N / P patches (rounded up) with the vision split (Note [vision split]), on all N
    without it. Counted with saved-tensor hooks on transformers' Qwen vision towers (SDPA attention, whose
    CPU and flash kernels keep the output and the log-sum-exp, no scores), per patch:
    * the patch embedding keeps its pixels: C T p^2;
    * a block keeps its input and norms' outputs, the packed qkv (3d), the rotated q and k (2d), the
      attention output (d) and its projection's input, the MLP's activations, the rotary tables (2 hd),
      the log-sum-exp (h) and the norms' statistics: ``a d + c I + 2 hd + h + 4`` with (a, c) = (11, 3) for
      Qwen2-VL (LayerNorm, quick-GELU MLP), (13, 4) for Qwen2.5-VL (RMSNorm, gated MLP) and (11, 2) for
      Qwen3-VL (LayerNorm, tanh-GELU MLP);
    * Qwen2.5-VL keeps its patches reordered into windows (d);
    * the merger keeps, per merged token, its norm's input and output (2 m d), its first projection's
      output and activation (2 m d), i.e. 4d a patch; each of Qwen3-VL's DeepStack mergers (one per
      ``deepstack_visual_indexes`` entry) as much again, 3d when the blocks are checkpointed (its input is
      then a block input the checkpoint keeps already).
    With the tower's blocks checkpointed (``gradient_checkpointing_enable()`` reaches them, and the estimate's
    "checkpointing" feature counts it so), a block keeps its input only (d a patch); its recomputed tensors
    exist during the tower's backward alone, after the decoder's activations are freed, and are left out.
    These tensors live from the tower's forward to its backward, which runs last, so they add to every moment
    of the decoder's step. Parameters (with their gradients and optimizer state, as the decoder's) are
    counted exactly from the config. What the tower does not keep does not count: the gathered features
    (the all-gather's output is consumed by ``masked_scatter``, which keeps only its mask) and the whole row's
    embeddings, transient in the forward, are left out. ``tests/test_memory.py`` checks the per-patch count
    against the hooks and the parameters against the built towers.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError


@dataclass(frozen=True)
class Tower:
    """One supported vision tower: how its config names its sizes and what its blocks are built of."""

    model_type: str
    """The vision config's ``model_type``."""
    coefficients: tuple[int, int]
    """(a, c) of a block's ``a d + c I`` kept elements per patch (Note [vision tower memory])."""
    layer_norm: bool = True
    """Its norms are LayerNorms (a bias each); False: RMSNorms."""
    gated_mlp: bool = False
    """Its blocks' MLP is gated (three biased projections); False: two."""
    embed_bias: bool = False
    """Its patch embedding has a bias."""
    windows: bool = False
    """It keeps its patches reordered into windows (a copy of the width a patch)."""
    ratio_names: bool = False
    """Its config names the width ``embed_dim``, the MLP by ``mlp_ratio`` and the output ``hidden_size``."""


TOWERS = {
    tower.model_type: tower
    for tower in (
        Tower("qwen2_vl_vision", (11, 3), ratio_names=True),  # LayerNorm, quick-GELU MLP
        Tower("qwen2_5_vl_vision", (13, 4), layer_norm=False, gated_mlp=True, windows=True),  # RMSNorm, gated MLP
        Tower("qwen3_vl_vision", (11, 2), embed_bias=True),  # LayerNorm, tanh-GELU MLP
    )
}
"""The towers whose memory seqpar counts: vision ``model_type`` -> its row."""


def _get(config: object, name: str, default: object = None) -> object:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


@dataclass(frozen=True)
class VisionSizes:
    """The sizes of a Qwen-VL vision tower that its memory depends on (Note [vision tower memory])."""

    model_type: str
    """The vision config's ``model_type``: a key of ``TOWERS``."""
    depth: int
    """Transformer blocks."""
    width: int
    """Hidden width d of the blocks."""
    mlp_width: int
    """MLP width I of the blocks."""
    heads: int
    """Attention heads."""
    patch_pixels: int
    """Pixels of one patch: channels x temporal patch x patch side squared."""
    merge: int
    """Patches merged into one decoder token (``spatial_merge_size`` squared)."""
    out_width: int
    """Width of the merged features (the decoder's hidden size)."""
    deepstack: int = 0
    """Qwen3-VL's DeepStack mergers."""
    position_embeddings: int = 0
    """Qwen3-VL's learned position table rows."""

    @classmethod
    def from_config(cls, config: object) -> VisionSizes:
        """The vision sizes of a multimodal transformers config (or the dict of its fields).

        Args:
            config: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL config, or its ``vision_config``.

        Returns:
            The ``VisionSizes``.

        Raises:
            SeqparInputError: no vision config, or a vision tower whose memory seqpar does not count.
        """
        vision = _get(config, "vision_config", None) or config
        kind = _get(vision, "model_type", None)
        tower = TOWERS.get(kind) if isinstance(kind, str) else None
        if tower is None:
            known = ", ".join(sorted(TOWERS))
            what = f"a {kind} tower" if vision is not config else f"a {kind or 'model'} config without a vision_config"
            raise SeqparInputError(
                f"cannot estimate the vision tower's memory of {what}: seqpar counts the towers {known}; leave "
                "vision_patches at 0 to estimate the decoder alone"
            )
        if tower.ratio_names:
            width = int(_get(vision, "embed_dim"))
            mlp, out = int(_get(vision, "mlp_ratio")) * width, int(_get(vision, "hidden_size"))
        else:
            width, mlp = int(_get(vision, "hidden_size")), int(_get(vision, "intermediate_size"))
            out = int(_get(vision, "out_hidden_size"))
        patch = int(_get(vision, "patch_size"))
        return cls(
            model_type=kind,
            depth=int(_get(vision, "depth")),
            width=width,
            mlp_width=mlp,
            heads=int(_get(vision, "num_heads")),
            patch_pixels=int(_get(vision, "in_channels", 3)) * int(_get(vision, "temporal_patch_size")) * patch**2,
            merge=int(_get(vision, "spatial_merge_size")) ** 2,
            out_width=out,
            deepstack=len(_get(vision, "deepstack_visual_indexes", None) or ()),
            position_embeddings=int(_get(vision, "num_position_embeddings", 0) or 0),
        )

    @property
    def tower(self) -> Tower:
        """The row of its tower."""
        return TOWERS[self.model_type]

    def num_params(self) -> int:
        """Parameters of the tower, counted from its modules' shapes."""
        d, i, md, tower = self.width, self.mlp_width, self.merge * self.width, self.tower
        norm = 2 * d if tower.layer_norm else d  # LayerNorm has a bias, RMSNorm has not
        mlp = 3 * d * i + 2 * i + d if tower.gated_mlp else 2 * d * i + i + d
        block = 2 * norm + 3 * d * d + 3 * d + d * d + d + mlp
        merger = md * md + md + md * self.out_width + self.out_width
        embed = self.patch_pixels * d + (d if tower.embed_bias else 0)
        deepstack = self.deepstack * (2 * md + merger)  # each DeepStack merger normalises after the shuffle
        return embed + self.position_embeddings * d + self.depth * block + norm + merger + deepstack

    def kept_elements_per_patch(self, checkpointing: bool = False) -> int:
        """Elements one patch keeps for the tower's backward (Note [vision tower memory]).

        Args:
            checkpointing: the tower's blocks are checkpointed (each keeps its input only).
        """
        a, c = self.tower.coefficients
        block = a * self.width + c * self.mlp_width + 2 * (self.width // self.heads) + self.heads + 4
        if checkpointing:
            block = self.width
        windows = self.width if self.tower.windows else 0  # the window-ordered copy
        # checkpointed, a DeepStack merger's input is a block input the checkpoint keeps already
        mergers = 4 * self.width + (3 if checkpointing else 4) * self.width * self.deepstack
        return self.patch_pixels + windows + self.depth * block + mergers

    def kept_bytes(self, patches: int, dtype_bytes: int, checkpointing: bool = False) -> int:
        """Bytes ``patches`` patches keep for the backward, in a dtype of ``dtype_bytes`` bytes.

        Args:
            patches: patches the tower runs on (this rank's).
            dtype_bytes: bytes per element.
            checkpointing: the tower's blocks are checkpointed.
        """
        return patches * self.kept_elements_per_patch(checkpointing) * dtype_bytes
