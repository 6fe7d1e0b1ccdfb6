"""What a diffusers attention class (or its processor) does that its names cannot tell: one row per class.

``seqpar.prepare_diffusers`` asks ``attention_row(module)`` before it judges or serves the module's calls;
``register_attention_row`` adds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner reads these tables without torch (Note [torch-free planning])
    import torch


@dataclass(frozen=True)
class AttentionRow:
    """One attention module class's (or processor class's) behaviour under ``seqpar.prepare_diffusers``."""

    text: str = "encoder_hidden_states"
    """The argument its forward takes the text (or other sequence) in."""
    cross: bool | None = None
    """Cross-attention (True: its keys are another sequence, the text every rank holds whole) or joint attention
    (False) where its projections' names and widths do not say; None: judged by its names (Note [derived
    attention])."""
    text_keys: str = ""
    """Where its processor joins the text's keys (and values) to the tokens' keys, the text asking no queries: "first"
    ([text; tokens]) or "last" ([tokens; text]); the text is then kept whole on every rank and attended by each
    rank's queries once (Note [gathered keys]). "": it does not."""
    padding_product: bool = False
    """Its processor builds the mask of each call over the call's own query-key pairs as the product of one
    per-token padding mask, as queries and as keys (Note [gathered keys]): served as the rows of this rank's
    queries against every key."""
    compacts_text: bool = False
    """Its processor drops the text's padding tokens (its ``attention_mask``) from the joint sequence and puts the
    valid tokens' outputs first, by their place in the text it is given: on a rank's cut text that is another place
    than one process's, so a call whose text has padding is refused (on every rank)."""
    segments: bool = False
    """Its processor takes the block-causal structure of a prefix as ``segments``, ``(start, end, is_text)`` runs of
    global positions it slices its queries by (each run sees every key before its end, a text run causally within
    itself, the queries after the prefix every key), and the keys' padding as ``key_valid``: served as the rows of
    that mask (Note [gathered keys])."""
    notes: str = ""
    """What the row was read from, for the guide."""


DIFFUSION_ATTENTION: dict[str, AttentionRow] = {
    "StableAudio3CrossAttention": AttentionRow(
        text="context", cross=True, notes="Stable Audio 3: the audio's queries against the text and duration context"
    ),
    "PRXAttention": AttentionRow(text_keys="first", notes="PRX: the image's queries against [text; image] keys"),
    "NucleusMoEAttnProcessor2_0": AttentionRow(
        text_keys="last", notes="NucleusMoE-Image: the image's queries against [image; text] keys"
    ),
    "QwenImage21Attention": AttentionRow(
        segments=True, notes="Qwen-Image 2.1: a causal prompt, each condition image a block, the target image last"
    ),
    "MochiAttention": AttentionRow(
        cross=False,
        compacts_text=True,
        notes="Mochi: a plain module attending jointly over [video; the text's valid tokens]",
    ),
    "HunyuanVideo15AttnProcessor2_0": AttentionRow(
        padding_product=True,
        notes="HunyuanVideo 1.5: the [video; text] key mask padded with True for the video, as queries and keys",
    ),
}
"""Attention module or processor class name -> its row."""


def attention_row(module: torch.nn.Module) -> AttentionRow | None:
    """The row of an attention module: its class's, else its processor's; None: neither has one."""
    row = DIFFUSION_ATTENTION.get(type(module).__name__)
    processor = getattr(module, "processor", None)
    return row if row is not None else DIFFUSION_ATTENTION.get(type(processor).__name__)


def register_attention_row(name: str, row: AttentionRow) -> AttentionRow:
    """Add (or replace) the row of an attention module class or processor class.

    Args:
        name: the class name (``type(module).__name__`` or ``type(module.processor).__name__``).
        row: what the class does that its names cannot tell.

    Returns:
        The row.
    """
    DIFFUSION_ATTENTION[name] = row
    return row
