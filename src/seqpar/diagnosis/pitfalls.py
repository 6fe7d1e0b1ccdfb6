"""Setup pitfalls found by looking at a batch and a model, before anything runs (``seqpar.doctor``).

Each finding names where it is and what to do; the batch the comparison then runs on leaves the culprit out.

Note [finding packed documents]
    A batch says that its rows hold several documents in one of three ways: ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` (transformers' ``DataCollatorWithFlattening``), a label of ``ignore_index`` standing
    alone between predicted tokens (the same collator's separator at each document's first token; a masked
    prompt or chat turn is longer than one token and is not taken for one), or an end-of-document token
    followed by more tokens (when the caller names ``eos_token_id``). Without position ids every token then
    attends to the documents before it in its row; with position ids, they must restart at 0 at each such
    start, or RoPE and seqpar's document mask run on into the next document.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from seqpar.data import shard_batch
from seqpar.diagnosis.report import Pitfall
from seqpar.errors import SeqparInputError
from seqpar.models import ModelAnatomy, find_anatomy
from seqpar.sequence_parallel.masks.sequence_mask import check_packed_positions

_PACKING_FIX = (
    "give position_ids that restart at 0 at every document (DataCollatorWithFlattening(return_position_ids=True), "
    "seqpar.pack_documents, or seqpar train's --data packing); seqpar keeps documents apart by them"
)
# class-name pieces of modules that mix tokens without attention (state-space, convolutional, linear-attention
# and MLP-Mixer blocks): what a layer's code may hold beyond what its family's entry names
_MIXER_NAMES = ("mamba", "mixer", "deltanet", "linearattention", "rwkv", "shortconv", "hyena", "retention", "cumsum")
_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout)


def _as_2d(value: object) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t[None] if t.dim() == 1 else t


def _document_starts(batch: Mapping[str, object], ids: torch.Tensor, ignore_index: int, eos: int | None):
    """``[B, S]`` bool: tokens the batch marks as a document's first token (Note [finding packed documents])."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    evidence = []
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if batch.get(key) is not None and ids.shape[0] == 1:
            cuts = [int(c) for c in torch.as_tensor(batch[key]).flatten() if 0 < int(c) < ids.shape[1]]
            if cuts:
                starts[0, cuts] = True
                evidence.append(key)
                break
    if batch.get("labels") is not None and ids.shape[1] > 2:
        labels = _as_2d(batch["labels"]).to(ids.device)
        alone = (labels[:, 1:-1] == ignore_index) & (labels[:, :-2] != ignore_index) & (labels[:, 2:] != ignore_index)
        if alone.any():
            starts[:, 1:-1] |= alone
            evidence.append(f"labels of {ignore_index} between predicted tokens")
    if eos is not None:
        after_eos = ids[:, :-1] == eos
        if after_eos.any():
            starts[:, 1:] |= after_eos
            evidence.append(f"end-of-document token {eos} inside rows")
    return starts, evidence


def _packing_pitfalls(batch, ids, ignore_index, eos) -> tuple[list[Pitfall], bool]:
    """Pitfalls of packed rows, and whether the batch's position ids must be left out of the comparison."""
    positions = batch.get("position_ids")
    if positions is not None:
        positions = _as_2d(positions).to(ids.device)
        try:
            check_packed_positions(positions)
        except SeqparInputError as error:
            return [Pitfall("packing", "batch['position_ids']", str(error), _PACKING_FIX)], True
    starts, evidence = _document_starts(batch, ids, ignore_index, eos)
    if not starts.any():
        return [], False
    why = " and ".join(evidence)
    if positions is None:
        problem = (
            f"rows hold several documents ({why}) but the batch has no position_ids: every token attends to the "
            "documents before it in its row, and RoPE counts on across documents"
        )
        return [Pitfall("packing", "batch['position_ids']", problem, _PACKING_FIX)], False
    run_on = starts & (positions != 0)
    if run_on.any():
        b, i = (int(x) for x in run_on.nonzero()[0])
        problem = (
            f"position ids run on across a document start ({why}): row {b} goes {int(positions[b, i - 1])} -> "
            f"{int(positions[b, i])} at token {i}, so that document attends to the one before it"
        )
        return [Pitfall("packing", "batch['position_ids']", problem, _PACKING_FIX)], False
    return [], False


def batch_pitfalls(
    batch: Mapping[str, object], *, ignore_index: int, eos_token_id: int | None = None
) -> tuple[list[Pitfall], dict[str, object], list[str]]:
    """Pitfalls of a global batch: packed rows without restarting position ids, shifted labels, left padding.

    Args:
        batch: the global batch as ``seqpar.shard_batch`` takes it.
        ignore_index: label value the loss ignores.
        eos_token_id: the end-of-document token, if packed documents end with one.

    Returns:
        The pitfalls; the batch to compare on (the culprits left out: shifted labels, a left-padding
        attention mask, position ids that are not packed ids); the names of what was left out.

    Raises:
        SeqparInputError: a batch without ``input_ids``.
    """
    if batch.get("input_ids") is None:
        raise SeqparInputError("the batch needs 'input_ids'")
    ids = _as_2d(batch["input_ids"])
    keep = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "shift_labels", "position_ids")}
    keep.update({k: batch[k] for k in ("attention_mask",) if batch.get(k) is not None})
    dropped: list[str] = []
    found, bad_positions = _packing_pitfalls(batch, ids, ignore_index, eos_token_id)
    if bad_positions:
        dropped.append("position_ids")
        keep.pop("position_ids")
    labels = batch.get("labels")
    if labels is not None and _as_2d(labels).shape == ids.shape:
        try:  # shard_batch's own refusal of labels shifted already, on one process (no communication)
            shard_batch({"input_ids": ids, "labels": _as_2d(labels)}, None, ignore_index=ignore_index)
        except SeqparInputError as error:
            fix = "pass labels aligned with input_ids (shard_batch shifts them once), or pass them as shift_labels"
            found.append(Pitfall("labels", "batch['labels']", str(error), fix))
            dropped.append("labels")
            keep.pop("labels")
    mask = batch.get("attention_mask")
    if mask is not None:
        real = _as_2d(mask) != 0
        if (real[:, 1:] & ~real[:, :-1]).any():
            row = int((real[:, 1:] & ~real[:, :-1]).any(1).nonzero()[0])
            problem = f"row {row} is padded on the left; seqpar takes right padding only (shard_batch refuses it)"
            fix = "pad on the right (tokenizer.padding_side = 'right'), or pack documents instead of padding"
            found.append(Pitfall("padding", "batch['attention_mask']", problem, fix))
            dropped.append("attention_mask")
            keep.pop("attention_mask")
    return found, keep, dropped


def decoder_layers(model: torch.nn.Module) -> tuple[str, ModelAnatomy]:
    """The qualified name of a model's decoder layers (``model.layers``) and its anatomy (Note [model families]).

    Args:
        model: a transformers model of a registered family (``seqpar.models.FAMILIES``).

    Returns:
        (qualified name of the layer list, the model's ``ModelAnatomy``: ``.layers``, ``.attention``, ...).

    Raises:
        SeqparInputError: a model whose family or layers ``seqpar.models`` does not know.
    """
    found = find_anatomy(model)
    if isinstance(found, str):
        raise SeqparInputError(
            f"cannot find the decoder layers of {type(model).__name__}: {found}; seqpar.doctor takes transformers "
            "models of the families seqpar.models knows"
        )
    return found.name(found.layers), found


def token_mixing_suspects(parts: ModelAnatomy, index: int) -> list[str]:
    """Modules of one layer, outside its attention, that mix tokens: the family's own token mixers, and what
    looks like one by type (convolutions, known mixer blocks; not by running).

    Args:
        parts: the model's anatomy.
        index: the layer.

    Returns:
        Qualified names of the layer's declared mixers, convolutions with a kernel wider than 1 and modules of
        known token-mixing block types.
    """
    layer, attention = parts.layers[index], parts.attention[index]
    inside_attention = {id(m) for m in attention.modules()} if attention is not None else set()
    declared = {id(m) for m in parts.mixers}
    found = []
    for module in layer.modules():
        if module is layer or id(module) in inside_attention:
            continue
        conv = isinstance(module, _CONVOLUTIONS) and max(module.kernel_size) > 1
        if id(module) in declared or conv or any(piece in type(module).__name__.lower() for piece in _MIXER_NAMES):
            found.append(parts.name(module))
    return found


def dropout_pitfalls(model: torch.nn.Module) -> list[Pitfall]:
    """Dropout that makes two runs of the same batch differ: active modules, and attention dropout in the config.

    Args:
        model: the model as the caller trains it (``model.training`` decides whether dropout is active).

    Returns:
        One pitfall per active dropout module or dropout config field.
    """
    found = []
    config = getattr(model, "config", None)
    if getattr(config, "attention_dropout", 0.0):
        problem = (
            f"attention_dropout is {config.attention_dropout}; seqpar attention has none (prepare_model refuses it)"
        )
        found.append(Pitfall("dropout", "config.attention_dropout", problem, "set config.attention_dropout = 0"))
    if not model.training:
        return found
    fix = "compare with model.eval() (or p = 0); sharded and one-process runs draw different dropout masks"
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUTS) and module.p > 0:
            found.append(Pitfall("dropout", name, f"dropout p={module.p} is active (model.training)", fix))
    return found


def baseline_notes(model: torch.nn.Module, batch: Mapping[str, object]) -> list[Pitfall]:
    """What makes a plain transformers run of packed rows (the usual one-GPU baseline) mix documents.

    transformers keeps documents apart by restarting position ids only with eager/SDPA attention when it is
    called without a cache and without an attention mask; ``config.use_cache`` is True by default, so
    ``model(input_ids=..., position_ids=..., labels=...)`` attends across documents, while seqpar does not.

    Args:
        model: the caller's model.
        batch: the global batch.

    Returns:
        One note when the rows are packed and such a baseline would mix their documents, else none.
    """
    positions = batch.get("position_ids")
    config = getattr(model, "config", None)
    implementation = str(getattr(config, "_attn_implementation", ""))
    if positions is None or implementation.startswith("flash") or not bool((_as_2d(positions)[:, 1:] == 0).any()):
        return []
    why = [w for w, on in (("config.use_cache", getattr(config, "use_cache", False)),) if on]
    why += ["batch['attention_mask']"] if batch.get("attention_mask") is not None else []
    if not why:
        return []
    problem = (
        f"the rows are packed; with {' and '.join(why)} a plain transformers call ({implementation} attention) "
        "attends across the documents, which seqpar (and the doctor's reference) keeps apart"
    )
    fix = "compare with a one-process baseline called with use_cache=False and without attention_mask"
    return [Pitfall("baseline", " and ".join(why), problem, fix)]
