"""Differences between the sharded run and one process, per decoder layer, and what they point to.

``layer_rows`` measures (Note [doctor tolerances]); ``diagnose`` names the first failing layer and its cause.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.diagnosis.capture import Capture
from seqpar.diagnosis.report import LayerRow, Pitfall
from seqpar.sequence_parallel.comm.collectives import collective_device

OUTPUT_ROW = "output"
_TINY = 1e-30


def max_over(values: torch.Tensor, group: object) -> torch.Tensor:
    """Elementwise maximum of a float64 vector over ``group`` (collective).

    Args:
        values: a float64 vector; not modified.
        group: a ProcessGroup, or None (one process: ``values`` is returned).

    Returns:
        The maximum over the ranks, on ``values``' device.
    """
    if group is None or dist.get_world_size(group) == 1:
        return values
    moved = values.to(collective_device(group))
    dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=group)
    return moved.to(values.device)


def _activation_diffs(sharded: Capture, reference: Capture, group: object) -> dict[str, float]:
    """Relative difference of every output kept by both runs, the largest over the group's ranks."""
    got, want = sharded.outputs, reference.outputs
    keys = [k for k in want if k in got and got[k].shape == want[k].shape]
    local = torch.tensor(
        [float((got[k].double() - want[k].double()).abs().max()) for k in keys],
        dtype=torch.float64,
    )
    worst = max_over(local, group) if keys else local
    return {k: float(worst[i]) / max(reference.scales[k], _TINY) for i, k in enumerate(keys)}


def _gradient_diff(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> float:
    """Largest ``|sharded - reference|`` over the parameters, relative to the largest reference gradient."""
    diff, scale = 0.0, 0.0
    for got, want in pairs:
        if got is None and want is None:
            continue
        got = torch.zeros_like(want) if got is None else got
        want = torch.zeros_like(got) if want is None else want
        diff = max(diff, float((got.double() - want.double()).abs().max()))
        scale = max(scale, float(want.double().abs().max()))
    return diff / max(scale, _TINY) if diff else 0.0


def layer_rows(
    sharded_model: torch.nn.Module,
    reference_model: torch.nn.Module,
    captures: tuple[Capture, Capture],
    prefix: str,
    calls: list[int],
    tolerance: float,
    group: object,
) -> list[LayerRow]:
    """One row per decoder layer, then the output row (logits; gradients outside the layers).

    Args:
        sharded_model: the prepared copy after its backward and ``reduce_gradients``.
        reference_model: the one-process copy after its backward.
        captures: (sharded, reference) outputs; the reference's already cut to this rank's shard, and the
            logits kept under ``OUTPUT_ROW`` in both.
        prefix: the qualified name of the decoder layers.
        calls: seqpar attention calls per layer.
        tolerance: relative tolerance of the dtype.
        group: the SP process group (activation differences are maximised over it; collective).

    Returns:
        The rows, the output row last.
    """
    diffs = _activation_diffs(*captures, group)
    grads: dict[int, list] = {i: [] for i in range(-1, len(calls))}
    for (name, got), want in zip(sharded_model.named_parameters(), reference_model.parameters()):
        rest = name[len(prefix) + 1 :].split(".", 1)[0] if name.startswith(prefix + ".") else ""
        grads[int(rest) if rest.isdigit() else -1].append((got.grad, want.grad))
    order = list(captures[1].outputs)
    rows = []
    for i, n_calls in enumerate(calls):
        name = f"{prefix}.{i}"
        children = [k for k in order if k.startswith(name + ".") and diffs.get(k, 0.0) > tolerance]
        first = children[0].rsplit("#", 1)[0] if children else None
        rows.append(LayerRow(name, diffs.get(f"{name}#0", 0.0), _gradient_diff(grads[i]), n_calls, first, tolerance))
    rows.append(LayerRow(OUTPUT_ROW, diffs.get(f"{OUTPUT_ROW}#0", 0.0), _gradient_diff(grads[-1]), -1, None, tolerance))
    return rows


_ATTENTION_FIX = (
    "route the attention through transformers' AttentionInterface "
    "(ALL_ATTENTION_FUNCTIONS[config._attn_implementation]) so that seqpar.prepare_model serves it, "
    "or call seqpar.attention in it"
)
_MIXING_FIX = (
    "each rank holds only its shard of the sequence: make this module token-local, or gather the sequence "
    "around it (seqpar.gather_sequence / shard_sequence) as seqpar does for attention"
)


def attention_pitfalls(attention: list[str], calls: list[int]) -> list[Pitfall]:
    """Layers whose attention module ran no seqpar attention in the sharded forward.

    Args:
        attention: the qualified name of each layer's attention module (its family's entry).
        calls: seqpar attention calls per layer.

    Returns:
        One pitfall per such layer, naming its attention module.
    """
    found = []
    for name, n_calls in zip(attention, calls):
        if n_calls == 0:
            problem = (
                "computes attention without seqpar (no call of seqpar attention in the sharded forward): each rank "
                "attends only within its own shard"
            )
            found.append(Pitfall("attention", name, problem, _ATTENTION_FIX))
    return found


def diagnose(
    rows: list[LayerRow], suspects: list[list[str]], attention: list[str]
) -> tuple[str | None, str, list[Pitfall]]:
    """The first failing layer, the cause in one sentence, and token-mixing pitfalls the rows reveal.

    Args:
        rows: from ``layer_rows`` (the output row last).
        suspects: per layer, modules that look like token mixers (``token_mixing_suspects``).
        attention: the qualified name of each layer's attention module.

    Returns:
        (first failing layer or None, cause, pitfalls); the cause is "" when everything agrees.
    """
    layers, output = rows[:-1], rows[-1]
    for i, row in enumerate(layers):
        if row.activation_ok:
            continue
        module = row.first_module or row.name
        if module in attention:
            if row.attention_calls == 0:
                return row.name, f"the attention in {module} does not go through seqpar (see the pitfalls)", []
            cause = (
                f"seqpar attention in {module} gives another result than the model's own attention on equal "
                "inputs: a seqpar problem, or an attention feature seqpar does not implement; please report it"
            )
            return row.name, cause, []
        inside = [s for s in suspects[i] if s == module or s.startswith(module + ".")]
        # the innermost suspects (a suspect block holding a suspect convolution names the convolution)
        named = [s for s in inside if not any(o.startswith(s + ".") for o in inside)] or [module]
        problem = "mixes tokens outside attention: its output differs while the layer's attention agrees"
        found = [Pitfall("token_mixing", name, problem, _MIXING_FIX) for name in named]
        return row.name, f"{', '.join(named)} mixes tokens outside attention (see the pitfalls)", found
    if not output.activation_ok:
        return OUTPUT_ROW, "the logits differ while every layer agrees: the final norm or head mixes tokens", []
    for row in reversed(layers):
        if not row.gradient_ok:
            where = "seqpar attention's backward" if row.attention_calls else "a module without seqpar attention"
            return row.name, f"gradients differ from this layer down while activations agree: {where}", []
    if not output.gradient_ok:
        return OUTPUT_ROW, "gradients of the embeddings, final norm or head differ while every layer agrees", []
    return None, "", []
