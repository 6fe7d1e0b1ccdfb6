"""Watching one forward of a model: the outputs of its decoder layers and their children, and seqpar attention calls.

Forward hooks (documented ``nn.Module`` hooks) keep what ``seqpar.doctor`` compares; nothing is patched.

Note [counting seqpar attention calls]
    A layer whose attention does not reach seqpar attends within its own shard only. To see that directly,
    the doctor re-registers, for the length of the sharded forward, the attention function that
    ``prepare_model`` registered under ``ATTENTION_NAME`` with a wrapper that counts calls per attention
    module and then calls it (``AttentionInterface.register``, transformers' documented extension point),
    and registers the original back afterwards. A layer with no call is then named as such.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from seqpar.sequence_parallel.prepare import ATTENTION_NAME


@dataclass
class Capture:
    """Outputs kept during one forward, keyed ``"<module name>#<call>"`` in the order the modules finished.

    ``scales`` holds the largest ``|value|`` of each whole output (filled by the reference run only).
    """

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)
    active: bool = True  # False after the forward: a recomputing backward (checkpointing) records nothing


def _first_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


@contextlib.contextmanager
def capture_outputs(
    layers: torch.nn.ModuleList,
    prefix: str,
    seq_len: int,
    take: Callable[[torch.Tensor], tuple[torch.Tensor, float]],
) -> Iterator[Capture]:
    """Keep ``take(output)`` of every decoder layer and of its direct children while the block runs.

    Only outputs shaped ``[B, seq_len, ...]`` (the sequence in dim 1) are kept; a module called twice is
    kept twice (``#0``, ``#1``).

    Args:
        layers: the model's decoder layers.
        prefix: their qualified name (``model.layers``).
        seq_len: the sequence length this run's outputs have (the shard's, or the whole one's).
        take: maps an output to what is kept and the scale it is measured against.

    Returns:
        A context manager yielding the ``Capture``; the hooks are removed when it exits.
    """
    capture = Capture()
    calls: collections.Counter = collections.Counter()

    def hook_for(name: str):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if not capture.active or tensor is None or tensor.dim() < 2 or tensor.shape[1] != seq_len:
                return
            key = f"{name}#{calls[name]}"
            calls[name] += 1
            capture.outputs[key], capture.scales[key] = take(tensor.detach())

        return hook

    handles = []
    for i, layer in enumerate(layers):
        for child, module in layer.named_children():
            handles.append(module.register_forward_hook(hook_for(f"{prefix}.{i}.{child}")))
        handles.append(layer.register_forward_hook(hook_for(f"{prefix}.{i}")))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def count_attention_calls() -> Iterator[collections.Counter]:
    """Count seqpar attention calls per attention module while the block runs (Note [counting seqpar attention calls]).

    Returns:
        A context manager yielding a Counter keyed by ``id(attention module)``.
    """
    from transformers import AttentionInterface

    original = AttentionInterface()[ATTENTION_NAME]
    counts: collections.Counter = collections.Counter()

    def counted(module, *args, **kwargs):
        counts[id(module)] += 1
        return original(module, *args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, counted)
    try:
        yield counts
    finally:
        AttentionInterface.register(ATTENTION_NAME, original)
