"""``seqpar.doctor``: one forward and backward of a model sharded over the SP group and on one process, compared.

Answers "does my sequence-parallel run differ from one GPU because of seqpar or because of my setup?".

Note [how the doctor compares]
    Every rank deep-copies the model twice. One copy is prepared with ``seqpar.prepare_model`` and runs this
    rank's ``seqpar.shard_batch`` shard; its loss is ``seqpar.cross_entropy`` over the global count of valid
    tokens and its gradients are summed over the group (``reduce_gradients``), which makes them the
    one-process gradients (Note [global token normalisation]). The other copy keeps the model's own attention
    and runs the whole (gathered, identically padded) batch on every rank, with the same loss. Forward hooks
    keep the outputs of every decoder layer and its children; the reference's are cut to this rank's shard
    with the same layout, so no activation is gathered. Both copies run in eval mode (no dropout); the
    dropout the caller's model would apply is reported as a pitfall instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from seqpar.data import IGNORE_INDEX, shard_batch
from seqpar.diagnosis.capture import capture_outputs, count_attention_calls
from seqpar.diagnosis.compare import OUTPUT_ROW, attention_pitfalls, diagnose, layer_rows, max_over
from seqpar.diagnosis.pitfalls import (
    baseline_notes,
    batch_pitfalls,
    decoder_layers,
    dropout_pitfalls,
    token_mixing_suspects,
)
from seqpar.diagnosis.report import TOLERANCES, DoctorReport, Pitfall
from seqpar.errors import SeqparInputError
from seqpar.gradients import reduce_gradients
from seqpar.loss import count_valid_tokens, cross_entropy, sum_over
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.sequence_parallel.layouts.chunks import gather_sequence, shard_sequence
from seqpar.sequence_parallel.mixers import implementations
from seqpar.sequence_parallel.prepare import is_prepared, last_attention_choice, prepare_model
from seqpar.sequence_parallel.strategies.registry import AUTO
from seqpar.sequence_parallel.whole_rows import SHARD_REFUSED


def _rank_pitfalls(model: torch.nn.Module, ids: torch.Tensor, sp: SequenceParallelMesh) -> list[Pitfall]:
    """Weights or batches that differ between the ranks of the group (one small all-reduce)."""
    if sp.sp_size == 1:
        return []
    params = [p.detach().double() for p in model.parameters()]
    tokens = ids.double()
    local = torch.tensor(
        [
            sum(float(p.sum()) for p in params),
            sum(float((p * p).sum()) for p in params),
            float(tokens.sum()),
            float((tokens * torch.arange(1, tokens.shape[-1] + 1, device=tokens.device)).sum()),
            float(tokens.numel()),
        ],
        dtype=torch.float64,
    )
    both = max_over(torch.cat([local, -local]), sp.sp_group)
    same = both[:5] == -both[5:]
    found = []
    if not bool(same[:2].all()):
        fix = "build the model from one seed on every rank or load one checkpoint (SP ranks replicate parameters)"
        found.append(Pitfall("ranks", "parameters", "the ranks of the SP group hold different weights", fix))
    if not bool(same[2:].all()):
        fix = "give every rank of the SP group the same global batch; seqpar.shard_batch takes each rank's part"
        found.append(Pitfall("ranks", "batch['input_ids']", "the ranks of the SP group hold different batches", fix))
    return found


def _sharded_run(model, shard, sp, prefix, layers, ignore_index):
    """Forward (outputs kept, attention calls counted), loss, backward and summed gradients of the prepared copy."""
    local_len = shard["input_ids"].shape[1]
    with (
        count_attention_calls() as counts,
        capture_outputs(layers, prefix, local_len, lambda t: (t.clone(), 0.0)) as cap,
    ):
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        cap.active = False
    cap.outputs[f"{OUTPUT_ROW}#0"] = logits.detach()
    n_valid = count_valid_tokens(shard["shift_labels"], sp, ignore_index)
    loss = cross_entropy(logits, shard["shift_labels"], sp, num_valid_tokens=n_valid, ignore_index=ignore_index)
    loss.backward()
    reduce_gradients(model.parameters(), sp)
    calls = [sum(counts[id(m)] for m in layer.modules()) for layer in layers]
    return cap, calls, n_valid, loss.detach()


def _reference_run(model, full, sp, layout, prefix, layers, n_valid, ignore_index):
    """Forward (outputs cut to this rank's shard), loss and backward of the one-process copy on the whole batch."""

    def take(t: torch.Tensor) -> tuple[torch.Tensor, float]:
        return shard_sequence(t, sp, dim=1, layout=layout), float(t.double().abs().max())

    with capture_outputs(layers, prefix, full["input_ids"].shape[1], take) as cap:
        # no cache: transformers keeps packed documents apart only without one (and without attention_mask)
        logits = model(input_ids=full["input_ids"], position_ids=full["position_ids"], use_cache=False).logits
        cap.active = False
    cap.outputs[f"{OUTPUT_ROW}#0"], cap.scales[f"{OUTPUT_ROW}#0"] = take(logits.detach())
    loss = cross_entropy(logits, full["shift_labels"], None, num_valid_tokens=n_valid, ignore_index=ignore_index)
    loss.backward()
    return cap, float(loss.detach())


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def doctor(
    model: torch.nn.Module,
    mesh: object,
    batch: Mapping[str, object],
    *,
    strategy: str = "auto",
    layout: str = "zigzag",
    kernel: str = "auto",
    tolerance: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    eos_token_id: int | None = None,
) -> DoctorReport:
    """One training step of ``model`` under sequence parallelism against one process (Note [how the doctor compares]).

    Collective over the SP group: call it on every rank with the same model weights and the same global
    batch. The model is not changed (the doctor works on copies). Also inspects the batch and the model for
    setup pitfalls (packed rows without restarting position ids, shifted labels, left padding, dropout,
    attention that bypasses seqpar, token mixing outside attention, ranks that disagree).

    Args:
        model: a transformers causal LM as it runs on one process, *not* yet prepared by ``prepare_model``.
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), the SP ProcessGroup, or None.
        batch: the global batch as ``seqpar.shard_batch`` takes it (``input_ids``; optional ``labels``,
            ``position_ids``, ``attention_mask``; ``cu_seq_lens_q`` is read as document evidence). A
            vision-language model's batch also carries the processor's pixels, grids and token types: both
            copies are then called with the whole rows (Note [whole-row calls]).
        strategy: as in ``seqpar.attention``.
        layout: "zigzag" or "contiguous".
        kernel: local attention kernel, as in ``seqpar.attention``.
        tolerance: relative tolerance; default by the parameters' dtype (``TOLERANCES``, Note [doctor tolerances]).
        ignore_index: label value the loss ignores.
        eos_token_id: the token that ends each packed document, if any (evidence of packed rows).

    Returns:
        The ``DoctorReport``, the same on every rank; ``print`` it, or read ``verdict``.

    Raises:
        SeqparInputError: a model already prepared, a model without decoder layers, or a batch without
            ``input_ids``. What seqpar refuses to run (``prepare_model``, ``shard_batch`` or the prepared
            model's call checks) is reported as a "refused" pitfall with no comparison instead.
    """
    sp = as_sp_mesh(mesh)
    if is_prepared(model):
        raise SeqparInputError(
            "seqpar.doctor takes the model before seqpar.prepare_model (it prepares a copy itself and runs the "
            "model's own attention as the one-process reference)"
        )
    prefix, _ = decoder_layers(model)
    dtype = _float_dtype(model)
    tol = tolerance if tolerance is not None else TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    report = DoctorReport(type(model).__name__, sp.sp_size, strategy, layout, dtype, tol)
    rows = _whole_row_data(batch)
    text = batch if rows is None else _text_part(batch)
    found, clean, report.compared_without = batch_pitfalls(text, ignore_index=ignore_index, eos_token_id=eos_token_id)
    device = next(model.parameters()).device
    clean = {k: torch.as_tensor(v).to(device) for k, v in clean.items()}
    report.pitfalls = found + dropout_pitfalls(model) + _rank_pitfalls(model, clean["input_ids"], sp)
    report.notes = baseline_notes(model, text)
    sharded, reference = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    if getattr(sharded.config, "attention_dropout", 0.0):  # reported above; eval mode applies none anyway
        sharded.config.attention_dropout = 0.0
    parts = decoder_layers(sharded)[1]
    layers = parts.layers
    ref_layers = decoder_layers(reference)[1].layers
    try:
        prepare_model(sharded, sp, strategy=strategy, layout=layout, kernel=kernel)
        shard = shard_batch(clean, sp, layout=layout, ignore_index=ignore_index)
        if rows is None:
            cap, calls, n_valid, loss = _sharded_run(sharded, shard, sp, prefix, layers, ignore_index)
        else:
            call = _row_call(rows, clean, batch, device)
            pair, both = (sharded, reference), (layers, ref_layers)
            runs = _whole_row_runs(pair, call, shard, sp, layout, prefix, both, ignore_index)
            (cap, calls, n_valid, loss), (ref_cap, ref_loss) = runs
    except SeqparInputError as error:  # agreed by every rank (Note [agreeing on errors])
        fix = "see the message; seqpar cannot run this model or batch as given"
        report.pitfalls.append(Pitfall("refused", type(model).__name__, str(error), fix))
        report.cause = f"seqpar refused the model or batch: {error}"
        return report
    choice = last_attention_choice(sharded)
    report.kernels = [k.line() for k in implementations(parts.mixers, device.type)]  # hub kernels included
    report.strategy = f"{strategy} -> {choice.strategy}" if choice is not None and strategy == AUTO else strategy
    if rows is None:
        full = {k: gather_sequence(v, sp, dim=1, layout=layout) for k, v in shard.items()}
        ref_cap, ref_loss = _reference_run(reference, full, sp, layout, prefix, ref_layers, n_valid, ignore_index)
    report.loss = (float(sum_over(loss, sp)), ref_loss)
    report.rows = layer_rows(sharded, reference, (cap, ref_cap), prefix, calls, tol, sp.sp_group)
    suspects = [token_mixing_suspects(parts, i) for i in range(len(layers))]
    attention = [parts.name(m) for m in parts.attention if m is not None]
    report.first_failing, report.cause, mixing = diagnose(report.rows, suspects, attention)
    attention_calls = [n for m, n in zip(parts.attention, calls, strict=True) if m is not None]
    report.pitfalls += attention_pitfalls(attention, attention_calls) + mixing
    return report


def _whole_row_data(batch: Mapping[str, object]) -> dict[str, object] | None:
    """The batch's pixels, grids and token types (Note [whole-row calls]), or None for a text batch."""
    data = {k: batch[k] for k in SHARD_REFUSED if batch.get(k) is not None}
    return data or None


def _text_part(batch: Mapping[str, object]) -> dict[str, object]:
    """What ``shard_batch`` and the batch checks take of a multimodal batch: ids, mask, labels, text positions.

    mRoPE positions in transformers' ``[4, B, S]`` form carry the text positions in their first row; the plain
    ``[3, B, S]`` form carries none (the model computes them from the grids).
    """
    text = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "shift_labels") if k in batch}
    positions = batch.get("position_ids")
    if positions is not None:
        positions = torch.as_tensor(positions)
        if positions.dim() == 2:
            text["position_ids"] = positions
        elif positions.dim() == 3 and positions.shape[0] == 4:
            text["position_ids"] = positions[0]
    return text


def _row_call(rows: dict, clean: dict, batch: Mapping[str, object], device: torch.device) -> dict[str, object]:
    """The keywords of the whole-row model call: the cleaned text tensors, the batch's positions, its pixels."""
    call = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rows.items()}
    call.update({k: clean[k] for k in ("input_ids", "attention_mask") if k in clean})
    positions = batch.get("position_ids")
    if positions is not None and "position_ids" in clean:  # left out when the batch checks found them wrong
        positions = torch.as_tensor(positions).to(device)
        call["position_ids"] = positions if positions.dim() == 3 else clean["position_ids"]
    return call


def _whole_row_runs(models, call, shard, sp, layout, prefix, layers, ignore_index):
    """The doctor's two runs of a multimodal model, both called with the whole rows (Note [whole-row calls]).

    The prepared copy returns this rank's logits; the one-process copy's outputs are padded as ``shard_batch``
    pads the row and cut to this rank's tokens. Both are compared on real tokens only (padding set to 0 in
    both), since seqpar's padding tokens are not the one process's.

    Returns:
        (capture, attention calls, valid tokens, loss) of the sharded run, (capture, loss) of the reference.
    """
    sharded, reference = models
    ids = call["input_ids"]
    length, local = ids.shape[1], shard["input_ids"].shape[1]
    padded = local * sp.sp_size
    real = call.get("attention_mask", torch.ones_like(ids)) != 0
    real_here = shard_sequence(torch.nn.functional.pad(real, (0, padded - length)), sp, dim=1, layout=layout)

    def masked(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return t * keep.view(*keep.shape, *([1] * (t.dim() - 2))).to(t.dtype)

    def take_sharded(t: torch.Tensor) -> tuple[torch.Tensor, float]:
        return masked(t, real_here), 0.0

    def take_reference(t: torch.Tensor) -> tuple[torch.Tensor, float]:
        whole = masked(t, real)
        grown = torch.nn.functional.pad(whole, (0, 0) * (t.dim() - 2) + (0, padded - length))
        return shard_sequence(grown, sp, dim=1, layout=layout), float(whole.double().abs().max())

    with count_attention_calls() as counts, capture_outputs(layers[0], prefix, local, take_sharded) as cap:
        logits = sharded(**call, seqpar_layout=shard.layout).logits
        cap.active = False
    cap.outputs[f"{OUTPUT_ROW}#0"] = take_sharded(logits.detach())[0]
    labels = shard["shift_labels"]
    n_valid = count_valid_tokens(labels, sp, ignore_index)
    loss = cross_entropy(logits, labels, sp, num_valid_tokens=n_valid, ignore_index=ignore_index)
    loss.backward()
    reduce_gradients(sharded.parameters(), sp)
    calls = [sum(counts[id(m)] for m in layer.modules()) for layer in layers[0]]
    with capture_outputs(layers[1], prefix, length, take_reference) as ref_cap:
        ref_logits = reference(**call).logits
        ref_cap.active = False
    ref_cap.outputs[f"{OUTPUT_ROW}#0"], ref_cap.scales[f"{OUTPUT_ROW}#0"] = take_reference(ref_logits.detach())
    whole_labels = gather_sequence(labels, sp, dim=1, layout=layout)[:, :length]
    ref_loss = cross_entropy(ref_logits, whole_labels, None, num_valid_tokens=n_valid, ignore_index=ignore_index)
    ref_loss.backward()
    return (cap, calls, n_valid, loss.detach()), (ref_cap, float(ref_loss.detach()))
