"""The vision work of a whole-row call split over the SP group: each rank encodes about 1/P of the images.

An all-gather whose backward sums the gradients over the group gives every rank the features of all images.

Note [vision split]
    Every rank of an SP group holds the same whole rows (Note [whole-row calls]), so without a split every rank
    runs the vision tower on every image: its time and activation memory do not fall with P. Instead, seqpar
    cuts the call's images into *units* the tower encodes independently and gives each rank a contiguous run
    of them, balanced by pixels:

    ==========================  ================================================================================
    family input                a unit
    ==========================  ================================================================================
    grids (Qwen2/2.5/3-VL)      one temporal patch of an image or video: ``(t, h, w)`` is t units ``(1, h, w)``
                                (the tower attends within a temporal patch: ``cu_seqlens`` per frame)
    ``pixel_values`` dim 0      one image (Gemma 3, LLaVA), one image's crops (LLaVA-OneVision), one row's tiles
                                (Idefics3, SmolVLM), one patch (InternVL), one video (LLaVA-Next-Video)
    ==========================  ================================================================================

    Each rank calls the model's own ``get_image_features`` / ``get_video_features`` on its units, the ranks
    all-gather the flattened features (the pooled output, and Qwen3-VL's DeepStack features), and every rank
    passes the whole result to the model as ``mm_encoder_outputs``, which the model merges as it merges its
    own. The backward of the gather sums the features' gradients over the group and keeps this rank's slice,
    so a rank's tower gradients are those of its units for every rank's tokens; the usual gradient sum over
    the group then gives one process's gradients. The split applies when there are at least as many units as
    ranks and every other tensor argument is per unit (LLaVA-OneVision's per-row ``batch_num_images`` keeps
    the call whole), and only for families whose registry entry declares ``vision_units`` (a tower that
    mixed images would make the split silently wrong); otherwise each rank encodes everything.
    ``prepare_model(..., split_vision=False)`` turns it off.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh

MODALITIES = (("image", "pixel_values", "get_image_features"), ("video", "pixel_values_videos", "get_video_features"))
"""(``mm_encoder_outputs`` key, pixel keyword, the model's encoder method) of each modality."""
_GRIDS = ("image_grid_thw", "video_grid_thw", "grid_thw")


class _GatherSummed(torch.autograd.Function):
    """All-gather of variable-length 1-D tensors; the backward sums gradients over the group (Note [vision split])."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, lengths: list[int], group: dist.ProcessGroup, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.lengths = group, rank, lengths
        width = max(lengths)
        padded = torch.nn.functional.pad(local, (0, width - local.numel()))
        parts = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, lengths, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's tokens used every unit's features
        start = sum(ctx.lengths[: ctx.rank])
        return grad[start : start + ctx.lengths[ctx.rank]], None, None, None


def _units(call: dict, pixels: torch.Tensor) -> tuple[list[int], list[int], list[int], str | None] | None:
    """(pixel rows of each unit, each unit's item, each unit's cost, the grid keyword) or None: the call cannot
    be split (a tensor argument that is neither the pixels, a grid nor per item)."""
    grid_key = next((k for k in _GRIDS if isinstance(call.get(k), torch.Tensor)), None)
    if grid_key is not None:
        grids = call[grid_key].tolist()
        rows = [h * w for t, h, w in grids for _ in range(t)]
        items = [i for i, (t, _, _) in enumerate(grids) for _ in range(t)]
        if sum(rows) != pixels.shape[0]:
            return None
        return rows, items, rows, grid_key
    n = pixels.shape[0]
    for value in call.values():
        if isinstance(value, torch.Tensor) and value is not pixels and (value.dim() == 0 or value.shape[0] != n):
            return None
    cost = int(pixels[0].numel()) if n else 0
    return [1] * n, list(range(n)), [cost] * n, None


def _share(costs: list[int], ranks: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous run of units ``[start, stop)``: rank k starts where the running cost first reaches
    k / ranks of the total, with at least one unit a rank (there are at least ``ranks`` units)."""
    total, running, cuts = sum(costs), 0, [0]
    for i, cost in enumerate(costs):
        while len(cuts) < ranks and running >= len(cuts) * total / ranks:
            cuts.append(i)
        running += cost
    cuts += [len(costs)] * (ranks + 1 - len(cuts))
    cuts[ranks] = len(costs)
    for k in range(1, ranks):  # at least one unit each, the last ranks included
        cuts[k] = min(max(cuts[k], cuts[k - 1] + 1), len(costs) - (ranks - k))
    return cuts[rank], cuts[rank + 1]


def _fields(output: object) -> list[tuple[str, int | None]]:
    """The per-unit fields of an encoder output: ``pooler_output``, and each layer of ``deepstack_features``."""
    layers = getattr(output, "deepstack_features", None)
    return [("pooler_output", None)] + [("deepstack_features", i) for i in range(len(layers or ()))]


def _get(output: object, field: tuple[str, int | None]) -> object:
    value = getattr(output, field[0])
    return value if field[1] is None else value[field[1]]


def _per_unit(value: object, count: int) -> list[torch.Tensor] | None:
    """A field as one tensor per unit (a tensor stacked over units, or a sequence of them), or None."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == count:
        return list(value.unbind(0))
    if isinstance(value, (list, tuple)) and len(value) == count and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def split_vision_features(decoder: torch.nn.Module, kwargs: dict, sp: SequenceParallelMesh) -> dict[str, object] | None:
    """Encode this rank's share of a whole-row call's images and videos and gather all (Note [vision split]).

    Args:
        decoder: the multimodal model whose ``get_image_features`` / ``get_video_features`` encode pixels.
        kwargs: the checked whole-row call's keywords (equal on every rank of the group).
        sp: the sequence-parallel mesh.

    Returns:
        ``mm_encoder_outputs`` for the call, every modality with pixels in it (those that cannot be split encoded
        whole on every rank), or None when none can be split (the model encodes its pixels itself).

    Raises:
        SeqparInputError: the family's encoder returned features that are not one per unit.
    """
    plans = []
    for modality, pixel_key, method_name in MODALITIES:
        pixels = kwargs.get(pixel_key)
        method: Callable | None = getattr(decoder, method_name, None)
        if not isinstance(pixels, torch.Tensor):
            continue
        if method is None:
            return None  # pixels this module does not encode: the model's own call keeps them
        names = inspect.signature(method).parameters
        first = next(iter(names))
        call = {k: kwargs[k] for k in names if k in kwargs and k != pixel_key and kwargs[k] is not None}
        call[first] = pixels
        units = _units(call, pixels)
        plans.append((modality, method, call, first, units if units and len(units[0]) >= sp.sp_size else None))
    if not any(units for *_, units in plans):
        return None
    # Models take either pixels or encoder outputs, so a modality that cannot be split is encoded whole here.
    return {
        modality: _encode(method, call, first, units, sp) if units else method(**call, return_dict=True)
        for modality, method, call, first, units in plans
    }


def _encode(
    method: Callable, call: dict, first: str, units: tuple[list[int], list[int], list[int], str | None], sp
) -> object:
    """This rank's units through the model's encoder method, then every unit's features from every rank."""
    rows, items, costs, grid_key = units
    start, stop = _share(costs, sp.sp_size, sp.sp_rank)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    local = dict(call)
    local[first] = call[first][offsets[start] : offsets[stop]]
    n = len(rows)
    if grid_key is not None:
        grids = call[grid_key]
        local[grid_key] = torch.stack([grids[items[u]] for u in range(start, stop)]).clone()
        local[grid_key][:, 0] = 1  # one temporal patch a unit
    else:
        for key, value in call.items():
            if key != first and isinstance(value, torch.Tensor) and value.shape[0] == n:
                local[key] = value[start:stop]
    output = method(**local, return_dict=True)
    fields = _fields(output)
    per_field = [_per_unit(_get(output, f), stop - start) for f in fields]
    bad = any(v is None for v in per_field)
    shapes = None if bad else [[tuple(t.shape) for t in units_of] for units_of in per_field]
    table: list = [None] * sp.sp_size
    dist.all_gather_object(table, (bad, shapes), group=sp.sp_group)
    if any(row[0] for row in table):
        raise SeqparInputError(
            "this family's vision encoder does not return one feature tensor per image, patch or frame, so its "
            "work cannot be split over the sequence-parallel group: prepare_model(..., split_vision=False)"
        )
    flat = torch.cat([t.reshape(-1) for units_of in per_field for t in units_of])
    if torch.is_grad_enabled() and not flat.requires_grad:
        flat = flat.detach().requires_grad_()  # every rank takes part in the gather's backward
    lengths = [sum(int(torch.Size(s).numel()) for layer in row[1] for s in layer) for row in table]
    gathered = _GatherSummed.apply(flat, lengths, sp.sp_group, sp.sp_rank)
    every: list[list[torch.Tensor]] = [[] for _ in fields]  # per field, every unit in order
    at = 0
    for row in table:
        for f, layer in enumerate(row[1]):
            for shape in layer:
                size = int(torch.Size(shape).numel())
                every[f].append(gathered[at : at + size].view(shape))
                at += size
    result = {}
    for f, field in enumerate(fields):
        value = _get(output, field)
        if grid_key is not None:  # units back into images and videos (a unit's item never decreases)
            groups = itertools.groupby(zip(items, every[f], strict=True), key=lambda pair: pair[0])
            merged = [torch.cat([t for _, t in group]) for _, group in groups]
        else:
            merged = every[f]
        whole = torch.stack(merged) if isinstance(value, torch.Tensor) else type(value)(merged)
        if field[1] is None:
            result[field[0]] = whole
        else:
            result.setdefault(field[0], []).append(whole)
    return type(output)(**result)


def encode_over_group(encoder: torch.nn.Module, kwargs: dict, sp: SequenceParallelMesh) -> None:
    """Put the split encoding of a checked whole-row call into its keywords as ``mm_encoder_outputs`` (the
    pixels removed: the models take one or the other); leave the call as it is when nothing can be split or
    the call brings its own encoder outputs.

    Raises:
        SeqparInputError: as ``split_vision_features``.
    """
    if kwargs.get("mm_encoder_outputs") is not None:
        return
    encoded = split_vision_features(encoder, kwargs, sp)
    if encoded is not None:
        kwargs["mm_encoder_outputs"] = encoded
        for _, pixel_key, _ in MODALITIES:
            kwargs.pop(pixel_key, None)
