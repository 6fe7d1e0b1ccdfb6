"""Generated whole multimodal rows for ``seqpar doctor``: random pixels and the placeholder runs a processor makes.

Read from the model's config alone (no processor, nothing downloaded): Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Gemma 3.
"""

from __future__ import annotations

import math

import torch

from seqpar.errors import SeqparInputError
from seqpar.models import FAMILIES


def generated_families() -> tuple[str, ...]:
    """Model types whose batches ``generated_multimodal_batch`` can lay out from the config (``Family.image_rows``),
    by layout."""
    return tuple(t for rows in _ROWS for t, family in FAMILIES.items() if family.image_rows == rows)


def is_multimodal(config: object) -> bool:
    """Whether a transformers config describes a model with a vision tower (it has a ``vision_config``).

    Args:
        config: a transformers config.

    Returns:
        True for vision-language configs.
    """
    return getattr(config, "vision_config", None) is not None


def _text_tokens(count: int, vocab: int, special: set[int], gen: torch.Generator) -> list[int]:
    """``count`` random ordinary tokens: none of the image, video or delimiter ids, nor 0 (padding in most)."""
    if all(t in special for t in range(1, vocab)):
        raise SeqparInputError(f"the text vocabulary ({vocab} tokens) holds no token besides the image ids")
    tokens = torch.randint(1, vocab, (count + 8 * len(special) + 8,), generator=gen).tolist()
    kept = [t for t in tokens if t not in special]
    while len(kept) < count:  # a tiny vocabulary that is mostly special ids
        kept += [t for t in torch.randint(1, vocab, (count,), generator=gen).tolist() if t not in special]
    return kept[:count]


def _fill(
    runs: list[list[int]], seq_len: int, vocab: int, special: set[int], gen: torch.Generator, shift: int = 0
) -> list[int]:
    """Text, each run, text between and after, to exactly ``seq_len`` tokens (the text split evenly, the first
    piece ``shift`` tokens longer and the last as much shorter where they can be)."""
    text = seq_len - sum(len(r) for r in runs)
    if text < len(runs) + 1:
        raise SeqparInputError(
            f"--seq-len {seq_len} is too short for the generated images ({sum(len(r) for r in runs)} placeholder "
            "tokens); raise it"
        )
    pieces = [text // (len(runs) + 1) + (1 if i < text % (len(runs) + 1) else 0) for i in range(len(runs) + 1)]
    shift = min(shift, pieces[-1] - 1)
    pieces[0], pieces[-1] = pieces[0] + shift, pieces[-1] - shift
    row = _text_tokens(pieces[0], vocab, special, gen)
    for run, after in zip(runs, pieces[1:], strict=True):
        row += run + _text_tokens(after, vocab, special, gen)
    return row


def _qwen_rows(config: object, seq_len: int, batch_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Two images a row, one grid of ``k x k`` merged tokens and one of ``k x (k + 1)``, between vision delimiters."""
    vision = config.vision_config
    patch, temporal, merge = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    special = {image, start, end, config.video_token_id}
    side = max(1, math.isqrt(max(1, seq_len // 8)))  # the images take about a quarter of the row
    grids, rows = [], []
    for _ in range(batch_size):
        row_grids = [(1, side * merge, side * merge), (1, side * merge, (side + 1) * merge)]
        runs = [[start, *[image] * (h * w // merge**2), end] for _, h, w in row_grids]
        rows.append(_fill(runs, seq_len, config.get_text_config().vocab_size, special, gen))
        grids += row_grids
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), channels * temporal * patch * patch, generator=gen)
    ids = torch.tensor(rows)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "mm_token_type_ids": (ids == image).int(),
    }


def _gemma3_rows(config: object, seq_len: int, batch_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Two images a row between begin/end tokens, each row's a token later than the row before's (per-row blocks)."""
    vision = config.vision_config
    image, begin, end = config.image_token_id, config.boi_token_index, config.eoi_token_index
    run = [begin, *[image] * config.mm_tokens_per_image, end]
    vocab, special = config.get_text_config().vocab_size, {image, begin, end}
    ids = torch.tensor([_fill([run, run], seq_len, vocab, special, gen, shift=b) for b in range(batch_size)])
    pixels = torch.randn(2 * batch_size, vision.num_channels, vision.image_size, vision.image_size, generator=gen)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "token_type_ids": (ids == image).long(),
    }


_ROWS = {"grids": _qwen_rows, "blocks": _gemma3_rows}
"""``Family.image_rows`` -> the function that lays its rows out."""


def generated_multimodal_batch(config: object, seq_len: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Whole rows of text and images, as the family's processor and chat template lay them out, random pixels.

    Each row holds two images of different sizes (Qwen-VL) or two images, in each row at other tokens (Gemma 3:
    its image blocks then differ by row), between text; the model is
    called with these whole rows on every rank (the contract of ``seqpar.doctor`` for multimodal batches).

    Args:
        config: the model's transformers config (a ``vision_config`` and the placeholder ids).
        seq_len: tokens per row.
        batch_size: rows.
        seed: seeds the text tokens and pixels.

    Returns:
        The batch: ``input_ids``, ``attention_mask``, the pixels and the family's grid and token-type keys.

    Raises:
        SeqparInputError: a family without ``Family.image_rows`` (naming it), or rows too short for the images.
    """
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None or family.image_rows is None:
        raise SeqparInputError(
            f"seqpar doctor generates image batches for {', '.join(generated_families())}, not {model_type!r}: call "
            "seqpar.doctor(model, mesh, batch) with a batch from your own collator (whole rows)"
        )
    rows = _ROWS[family.image_rows]
    return rows(config, seq_len, batch_size, torch.Generator().manual_seed(seed))
