"""Token mixers other than attention, served under sequence parallelism: one adapter per transformers module class.

``prepare_model`` swaps each mixer's class for its adapter (Note [mixer adapters]); an unknown mixer is refused.

Note [mixer adapters]
    A hybrid model's convolutions and recurrences mix tokens, so on a shard they would see only their own
    rank's tokens. Each known mixer class (keyed by its transformers class name) has an adapter: a subclass
    that overrides ``forward`` only and exchanges across the SP group what its layer needs (Note [halo
    convolution], Note [state passing]). ``prepare_model`` sets each mixer's ``__class__`` to it, so
    parameters, their names, the state dict, hooks and wrappers (FSDP2, PEFT) are those of the model as built.
    A mixer class with no adapter stops ``prepare_model`` with its name: it would run silently wrong.
"""

from __future__ import annotations

import functools

import torch

from seqpar.sequence_parallel.mixers.gated_deltanet import (
    kimi_delta_attention_forward,
    olmo_hybrid_gated_deltanet_forward,
    qwen3_5_gated_deltanet_forward,
    qwen3_next_gated_deltanet_forward,
)
from seqpar.sequence_parallel.mixers.lightning import minimax_lightning_attention_forward
from seqpar.sequence_parallel.mixers.mamba1 import mamba1_forward
from seqpar.sequence_parallel.mixers.mamba2 import mamba2_forward
from seqpar.sequence_parallel.mixers.short_conv import lfm2_short_conv_forward

__all__ = ["ADAPTERS", "adapt", "unknown_mixers"]

ADAPTERS = {
    "Lfm2ShortConv": lfm2_short_conv_forward,
    "Qwen3NextGatedDeltaNet": qwen3_next_gated_deltanet_forward,
    "Qwen3_5GatedDeltaNet": qwen3_5_gated_deltanet_forward,
    "Qwen3_5MoeGatedDeltaNet": qwen3_5_gated_deltanet_forward,
    "OlmoHybridGatedDeltaNet": olmo_hybrid_gated_deltanet_forward,
    "KimiLinearDeltaAttention": kimi_delta_attention_forward,
    "GraniteMoeHybridMambaLayer": mamba2_forward,
    "BambaMixer": mamba2_forward,
    "FalconH1Mixer": mamba2_forward,
    "NemotronHMamba2Mixer": mamba2_forward,
    "Mamba2Mixer": mamba2_forward,
    "Zamba2MambaMixer": mamba2_forward,
    "MambaMixer": mamba1_forward,
    "FalconMambaMixer": mamba1_forward,
    "JambaMambaMixer": mamba1_forward,
    "MiniMaxLightningAttention": minimax_lightning_attention_forward,
}
"""Mixer class name -> the ``forward`` of its adapter."""


@functools.cache
def _adapter_class(cls: type) -> type:
    """The adapter subclass of ``cls`` (made once per class, so every prepared model shares it)."""
    return type(f"Seqpar{cls.__name__}", (cls,), {"forward": ADAPTERS[cls.__name__], "__module__": __name__})


def unknown_mixers(mixers: tuple[torch.nn.Module, ...]) -> list[str]:
    """The class names of ``mixers`` that have no adapter (Note [mixer adapters]).

    Args:
        mixers: a model's token mixers other than attention (``ModelAnatomy.mixers``).

    Returns:
        The names, sorted, each once.
    """
    names = {type(m).__name__ for m in mixers if not type(m).__name__.startswith("Seqpar")}
    return sorted(n for n in names if n not in ADAPTERS)


def adapt(mixers: tuple[torch.nn.Module, ...]) -> None:
    """Swap each mixer's class for its adapter, in place (Note [mixer adapters]); adapted ones are left as they are.

    Args:
        mixers: token mixers whose classes all have adapters (``unknown_mixers`` is empty).
    """
    for mixer in mixers:
        if type(mixer).__name__ in ADAPTERS:
            mixer.__class__ = _adapter_class(type(mixer))
