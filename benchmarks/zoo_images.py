"""``python -m benchmarks.zoo_images``: the image-text-to-text families of the zoo with their images, whole rows
through seqpar's multimodal door, against one process (issue 58).

Run::

    python -m benchmarks.zoo_images                               # -> benchmarks/zoo_images_cpu.json
    python -m benchmarks.zoo_images --only llava,paligemma --sp 3 --out /tmp/images.json

Each family's tiny model (``seqpar.models.zoo.tiny_model``) gets one row of text around one image's
placeholders: the pixels are random, in the shape the family's vision tower takes (``image_inputs``), and the
placeholder count is what the tower makes of them in one process. The reference is that row in one process
(float32, and float64 for the floors); the run under test calls ``seqpar.prepare_model``'s model with the whole
row and its pixels on every rank (Note [whole-row calls]) and takes the loss with ``seqpar.cross_entropy`` on the
shard's labels. Loss, the shard's logits and every gradient (the vision tower's too) are judged as in
``benchmarks.zoo``. A family whose pixels no recipe here fits is IMAGES (no input recipe), not a verdict on seqpar.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Collection, Iterator
from datetime import timedelta
from typing import Any

import torch

from benchmarks import ROOT, save_records
from benchmarks.zoo import (
    BOTH,
    BUILD,
    CRASH,
    EXACT,
    HANG,
    REFUSED,
    WRONG,
    judged_run,
    last_line,
    pool_outcome,
    split_references,
)

NO_RECIPE = "IMAGES"
"""No pixel recipe here fits the family's vision tower (the reason says what failed)."""
STATUSES = (EXACT, REFUSED, WRONG, CRASH, HANG, BUILD, NO_RECIPE)
TEXT_BEFORE = 5
"""Text tokens before the image."""


def _image_token(config: Any) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _features(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("pooler_output", "last_hidden_state"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    return out


def _count(features: Any) -> int:
    """Placeholder tokens the image features fill: one per feature vector."""
    if isinstance(features, (list, tuple)):
        return sum(_count(f) for f in features)
    return features.shape[:-1].numel()


def _recipes(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Candidate pixel keywords for one image, in the layout the family's ``get_image_features`` names in its
    signature: Qwen-style patch rows with their grid, NaFlex patches with their shape, Gemma 4's patches with their
    positions, a batch of images per row with a pixel mask, crops with the image's size, or plain images (small
    first, then the config's size)."""
    vision = model.config.vision_config
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    patch = getattr(vision, "patch_size", None) or 14
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    merge = getattr(vision, "spatial_merge_size", None) or (getattr(vision, "merge_kernel_size", None) or [2])[0]
    frames = getattr(vision, "temporal_patch_size", None) or 1
    named = set(inspect.signature(getattr(model, "model", model).get_image_features).parameters)
    noise = torch.Generator().manual_seed(2)
    if "image_grid_thw" in named:
        grid = torch.tensor([[1, 2 * merge, 2 * merge]])
        rows = int(grid.prod())
        extra = {"image_merge_sizes": torch.tensor([merge])} if "image_merge_sizes" in named else {}
        for shape in ((rows, channels * frames * patch * patch), (rows, channels, patch, patch)):
            yield {"pixel_values": torch.randn(*shape, generator=noise), "image_grid_thw": grid, **extra}
    if "spatial_shapes" in named:
        side = 2 * merge
        yield {
            "pixel_values": torch.randn(1, side * side, channels * patch * patch, generator=noise),
            "spatial_shapes": torch.tensor([[side, side]]),
            "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.bool),
        }
    if "image_position_ids" in named:  # Gemma 4: flat patches with their (x, y), pooled k x k
        side = 2 * (getattr(vision, "pooling_kernel_size", None) or 1)
        xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(1, -1, 2)
        yield {"pixel_values": torch.randn(1, side * side, channels * patch * patch, generator=noise),
               "image_position_ids": xy}  # fmt: skip
    size = getattr(vision, "image_size", None) or 4 * patch
    size = size[0] if isinstance(size, (list, tuple)) else size
    for side in dict.fromkeys((4 * patch, size)):
        image = torch.randn(1, channels, side, side, generator=noise)
        if "pixel_attention_mask" in named:
            yield {"pixel_values": image[None], "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool)}
        yield {"pixel_values": image}
        yield {"pixel_values": image, "image_sizes": torch.tensor([[side, side]])}
        for crops in range(2, 10) if "image_sizes" in named else ():
            crops_of = torch.randn(1, crops, channels, side, side, generator=noise)
            yield {"pixel_values": crops_of, "image_sizes": torch.tensor([[side, side]])}


def image_inputs(model: torch.nn.Module, multiple: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | str:
    """One row of text around one image's placeholders and the pixels, for ``model``; or why no recipe fits.

    The row's length is a multiple of ``multiple`` (so every layout cuts it evenly); where the config names
    vision delimiters, they enclose the placeholders (mRoPE finds the image by its start token).
    """
    config = model.config
    token, vision = _image_token(config), getattr(config, "vision_config", None)
    if token is None or vision is None:
        return "no image_token_id and vision_config to build an image row from"
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_image_features"):
        return f"{type(inner).__name__} has no get_image_features to count an image's placeholders by"
    start, end = (getattr(config, k, None) for k in ("vision_start_token_id", "vision_end_token_id"))
    errors = []
    for extra in _recipes(model):
        try:
            with torch.no_grad():
                count = _count(_features(inner.get_image_features(**extra)))
                image = [*([start] if start is not None else []), *[token] * count, *([end] if end is not None else [])]
                after = -(TEXT_BEFORE + len(image)) % multiple or multiple
                text = torch.randint(4, 90, (1, TEXT_BEFORE + after), generator=torch.Generator().manual_seed(3))
                ids = torch.cat([text[:, :TEXT_BEFORE], torch.tensor([image]), text[:, TEXT_BEFORE:]], dim=1)
                if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # mRoPE finds images by them
                    extra = {**extra, "mm_token_type_ids": (ids == token).int()}
                model(input_ids=ids, **extra)
        except Exception as error:  # the next recipe, or none fits
            errors.append(last_line(error))
            continue
        return ids, extra
    return f"no pixel recipe fits its vision tower: {errors[-1] if errors else 'none to try'}"


def _reference(model: torch.nn.Module, ids: torch.Tensor, extra: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **extra).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _judge_family(
    rank: int, world_size: int, model_type: str, mappings: tuple[str, ...], control: bool | str
) -> dict[str, Any]:
    import transformers

    from seqpar.models.zoo import tiny_model

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tiny_model(model_type, mappings)
    if isinstance(model, str):
        return {"status": BUILD, "reason": model}
    made = image_inputs(model, math.lcm(4, 2 * world_size))
    if isinstance(made, str):
        return {"status": NO_RECIPE, "reason": made}
    ids, extra = made
    wide = {k: v.double() if v.is_floating_point() else v for k, v in extra.items()}
    pristine, want, exact = split_references(
        rank, world_size, model, lambda m: _reference(m, ids, extra), lambda m: _reference(m, ids, wide)
    )
    if isinstance(want, str):
        return {"status": NO_RECIPE, "reason": f"one process cannot run the image row: {want}"}

    def whole_rows(model: torch.nn.Module, shard: dict) -> torch.Tensor:
        return model(input_ids=ids, **extra).logits  # every rank the whole row and its pixels

    outcome = judged_run(pristine, rank, world_size, {"input_ids": ids}, whole_rows, want, exact, control)
    return outcome | {"tokens": ids.shape[1]}


def _family_on_rank(
    rank: int, world_size: int, model_type: str, mappings: tuple[str, ...], control: bool | str, out_dir: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome = _judge_family(rank, world_size, model_type, mappings, control)
        except Exception as error:  # a failure of the harness itself, reported rather than hung
            outcome = {"status": CRASH, "reason": f"harness: {last_line(error)}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def sweep(
    sp_size: int,
    only: list[str] | None = None,
    deadline_s: float = 120.0,
    control: bool = False,
    controls: Collection[str] = (),
    pool: Any = None,
) -> dict[str, dict[str, Any]]:
    """Judge every image-text-to-text family (or ``only`` those) with an image at ``sp_size``: type -> outcome.

    ``control``: the gradients are left unreduced, so every family that runs comes out WRONG. ``controls``:
    families whose outcome also holds that control, judged from the same run (``benchmarks.zoo.BOTH``) under
    "control". ``pool``: a ``RankPool`` of ``sp_size`` ranks to run on, left open (default: one of its own).
    """
    import transformers

    from seqpar.models.zoo import IMAGE_TEXT_TO_TEXT, zoo_model_types
    from tests._pool import RankPool

    transformers.logging.set_verbosity_error()
    entries = {k: v for k, v in zoo_model_types().items() if IMAGE_TEXT_TO_TEXT in v.mappings and not v.set_aside}
    if only:
        unknown = sorted(set(only) - set(entries))
        if unknown:
            raise SystemExit(f"not an image-text-to-text family of the zoo: {', '.join(unknown)}")
        entries = {k: v for k, v in entries.items() if k in only}
    results: dict[str, dict[str, Any]] = {}
    own = pool is None
    pool = RankPool(sp_size, timeout=timedelta(seconds=deadline_s / 2)) if own else pool
    if pool.world_size != sp_size:
        raise ValueError(f"a pool of {pool.world_size} ranks for a sweep at sp {sp_size}")
    try:
        for model_type in entries:
            started = time.perf_counter()
            mappings = (IMAGE_TEXT_TO_TEXT,)
            judged = BOTH if model_type in controls and not control else control
            outcome = pool_outcome(pool, _family_on_rank, model_type, mappings, judged, deadline_s=deadline_s)
            results[model_type] = outcome | {"seconds": round(time.perf_counter() - started, 2)}
            said = outcome.get("worst") if outcome["status"] in (EXACT, WRONG) else outcome.get("reason", "")
            print(f"{model_type:28s} {outcome['status']:8s} {results[model_type]['seconds']:6.1f}s  {said[:110]}")
    finally:
        if own:
            pool.close(kill=True)
    return results


def totals(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    found = Counter(r["status"] for r in results.values())
    return {s: found[s] for s in STATUSES}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel degree (ranks in the pool)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one)")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds one family may take before HANG")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "zoo_images_cpu.json"), help="the JSON record")
    args = parser.parse_args(argv)
    import transformers

    started = time.perf_counter()
    results = sweep(args.sp, [m for m in args.only.split(",") if m] or None, args.deadline)
    counts = totals(results)
    print("\n" + "  ".join(f"{s} {n}" for s, n in counts.items()))
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "sp": args.sp,
        "wall_s": round(time.perf_counter() - started, 1),
        "totals": counts,
        "models": results,
    }
    save_records(args.out, "zoo_images", argv, [record])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
