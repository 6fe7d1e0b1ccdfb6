"""Token mixers other than attention, served under sequence parallelism: one adapter per transformers module class.

``prepare_model`` swaps each mixer's class for its adapter (Note [mixer adapters]); an unknown mixer is refused.

Note [mixer adapters]
    A hybrid model's convolutions and recurrences mix tokens, so on a shard they would see only their own
    rank's tokens. Each known mixer class (keyed by its transformers class name) has an adapter: a subclass
    that overrides ``forward`` only and exchanges across the SP group what its layer needs (Note [halo
    convolution], Note [state passing]). ``prepare_model`` sets each mixer's ``__class__`` to it, so
    parameters, their names, the state dict, hooks and wrappers (FSDP2, PEFT) are those of the model as built.
    A mixer class with no adapter stops ``prepare_model`` with its name: it would run silently wrong. An
    adapter lists the attributes (and the kernel function of the class's module) that its ``forward`` reads;
    a mixer that lacks one, as another transformers version may build it, is refused naming what it lacks.
    Where the class's ``forward`` routes hub kernels (``kernels``' ``use_kernelized_func``), the adapter's is
    routed the same way (Note [hub kernels]).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqpar.sequence_parallel.mixers import hub
from seqpar.sequence_parallel.mixers.gated_deltanet import (
    bailing_delta_attention_forward,
    kimi_delta_attention_forward,
    olmo_hybrid_gated_deltanet_forward,
    qwen3_5_gated_deltanet_forward,
    qwen3_next_gated_deltanet_forward,
)
from seqpar.sequence_parallel.mixers.implementations import MixerKernel, mixer_kernels
from seqpar.sequence_parallel.mixers.lightning import minimax_lightning_attention_forward
from seqpar.sequence_parallel.mixers.mamba1 import mamba1_forward, zamba_mamba_forward
from seqpar.sequence_parallel.mixers.mamba2 import mamba2_forward
from seqpar.sequence_parallel.mixers.ngram import qwen4_exp_ple_forward
from seqpar.sequence_parallel.mixers.rg_lru import recurrent_gemma_recurrent_forward
from seqpar.sequence_parallel.mixers.rwkv import rwkv_channel_mix_forward, rwkv_time_mix_forward
from seqpar.sequence_parallel.mixers.short_conv import lfm2_short_conv_forward

__all__ = ["ADAPTERS", "MixerKernel", "adapt", "implementations", "mismatched_mixers", "unknown_mixers"]


@dataclass(frozen=True)
class MixerAdapter:
    """seqpar's adapter of one transformers mixer class (Note [mixer adapters])."""

    forward: Callable[..., object]
    """The ``forward`` that replaces the class's own."""
    reads: tuple[str, ...]
    """The module's attributes that ``forward`` reads: a mixer lacking one (another transformers version) is
    refused by ``prepare_model``, not left to fail inside a forward."""
    kernel: str | None = None
    """The function of the class's own transformers module that ``forward`` calls, if any (checked likewise)."""
    recurrent: bool = True
    """The mixer has a recurrence (run by ``kernel``, or by seqpar's own code where that is None)."""


_GATED_DELTANET = ("conv1d", "A_log", "dt_bias", "key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_v_heads")
_GATED_DELTANET_KERNEL = "torch_chunk_gated_delta_rule"
_QWEN3_5 = MixerAdapter(
    qwen3_5_gated_deltanet_forward,
    (*_GATED_DELTANET, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"),
    _GATED_DELTANET_KERNEL,
)
# Falcon-H1 builds ``norm`` only with ``mamba_rms_norm``, which the adapter reads first
_MAMBA2 = MixerAdapter(
    mamba2_forward,
    (
        *("in_proj", "conv1d", "intermediate_size", "conv_dim", "num_heads", "head_dim", "n_groups"),
        *("ssm_state_size", "A_log", "D", "dt_bias", "time_step_limit", "chunk_size", "out_proj"),
    ),
    "mamba2_chunk_scan",
)
_MAMBA1 = MixerAdapter(
    mamba1_forward,
    (
        *("in_proj", "conv1d", "use_conv_bias", "act", "x_proj", "dt_proj", "time_step_rank"),
        *("ssm_state_size", "intermediate_size", "A_log", "D", "out_proj"),
    ),
)

_SHORT_CONV = MixerAdapter(lfm2_short_conv_forward, ("in_proj", "conv", "out_proj"), recurrent=False)

_KDA = (
    *("q_proj", "k_proj", "v_proj", "conv1d", "qkv_dim", "head_dim", "num_heads", "forget_gate", "b_proj"),
    *("o_norm", "o_proj"),
)

ADAPTERS = {
    "Lfm2ShortConv": _SHORT_CONV,
    "Lfm2MoeShortConv": _SHORT_CONV,
    "Lfm3ShortConv": _SHORT_CONV,
    "Qwen3NextGatedDeltaNet": MixerAdapter(
        qwen3_next_gated_deltanet_forward,
        (*_GATED_DELTANET, "in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "norm", "out_proj"),
        _GATED_DELTANET_KERNEL,
    ),
    "Qwen3_5GatedDeltaNet": _QWEN3_5,
    "Qwen3_5MoeGatedDeltaNet": _QWEN3_5,
    "LaraMiniGatedDeltaNet": _QWEN3_5,
    "Qwen4ExpTextGatedDeltaNet": _QWEN3_5,
    # Qwen4-Exp's per-layer n-gram embeddings: the token ids' halo and the dilated convolution's (Note [n-gram halo])
    "Qwen4ExpTextPLELayer": MixerAdapter(
        qwen4_exp_ple_forward,
        (
            *("ple_embedding", "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d"),
            *("hc_count", "hidden_size"),
        ),
        recurrent=False,
    ),
    "OlmoHybridGatedDeltaNet": MixerAdapter(
        olmo_hybrid_gated_deltanet_forward,
        (
            *_GATED_DELTANET,
            *("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj", "allow_neg_eigval", "o_norm", "o_proj"),
        ),
        _GATED_DELTANET_KERNEL,
    ),
    "KimiLinearDeltaAttention": MixerAdapter(
        kimi_delta_attention_forward, (*_KDA, "g_a_proj", "g_b_proj"), "chunk_kimi_delta_attention"
    ),
    "BailingHybridDeltaAttention": MixerAdapter(
        bailing_delta_attention_forward, (*_KDA, "g_proj"), "chunk_kimi_delta_attention"
    ),
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "FalconH1Mixer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "Mamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "MambaMixer": _MAMBA1,
    "FalconMambaMixer": _MAMBA1,
    "JambaMambaMixer": _MAMBA1,
    "ZambaMambaMixer": MixerAdapter(  # Mamba1 in heads, each with its own x and dt projections (Note [Mamba1 state])
        zamba_mamba_forward,
        (
            *("in_proj", "conv1d", "use_conv_bias", "act", "n_mamba_heads", "mamba_head_dim", "ssm_state_size"),
            *("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "time_step_rank", "A_log", "D", "out_proj"),
        ),
    ),
    "MiniMaxLightningAttention": MixerAdapter(
        minimax_lightning_attention_forward,
        (
            *("qkv_proj", "act_fn", "num_attention_heads", "head_dim", "block_size", "slope_rate", "query_decay"),
            *("key_decay", "diagonal_decay", "norm", "output_gate", "out_proj"),
        ),
    ),
    # the RG-LRU and its convolution (Note [RG-LRU state]); its recurrence is seqpar's loop, as transformers' is
    "RecurrentGemmaRecurrentBlock": MixerAdapter(
        recurrent_gemma_recurrent_forward, ("linear_y", "linear_x", "conv_1d", "rg_lru", "act_fn", "linear_out")
    ),
    # RWKV-4's time and channel mixing (Note [WKV state]): the token shift's halo, and the WKV loop, seqpar's
    "RwkvSelfAttention": MixerAdapter(
        rwkv_time_mix_forward,
        (
            *("time_decay", "time_first", "time_mix_key", "time_mix_value", "time_mix_receptance"),
            *("key", "value", "receptance", "output"),
        ),
    ),
    "RwkvFeedForward": MixerAdapter(
        rwkv_channel_mix_forward,
        ("time_mix_key", "time_mix_receptance", "key", "receptance", "value"),
        recurrent=False,
    ),
}
"""Mixer class name -> its adapter."""


@functools.cache
def _adapter_class(cls: type) -> type:
    """The adapter subclass of ``cls`` (made once per class, so every prepared model shares it)."""
    return hub.adapter_class(cls, ADAPTERS[cls.__name__].forward, __name__)


def unknown_mixers(mixers: tuple[torch.nn.Module, ...]) -> list[str]:
    """The class names of ``mixers`` that have no adapter (Note [mixer adapters]).

    Args:
        mixers: a model's token mixers other than attention (``ModelAnatomy.mixers``).

    Returns:
        The names, sorted, each once.
    """
    return sorted({_built_class(m).__name__ for m in mixers} - ADAPTERS.keys())


def _built_class(mixer: torch.nn.Module) -> type:
    """The transformers class of ``mixer``, adapted or not."""
    cls = type(mixer)
    return cls.__mro__[1] if cls.__name__.startswith("Seqpar") and cls.__module__ == __name__ else cls


def mismatched_mixers(mixers: tuple[torch.nn.Module, ...]) -> list[str]:
    """What each adapted mixer class lacks of what its adapter reads (Note [mixer adapters]).

    A transformers version whose mixer renamed or dropped an attribute or its kernel function would otherwise
    fail inside the first forward (or, worse, run on with a default); a ``kernels`` version whose routing of hub
    kernels seqpar cannot read would lose them silently (Note [hub kernels]).

    Args:
        mixers: token mixers whose classes all have adapters (``unknown_mixers`` is empty).

    Returns:
        One line per class that lacks something, naming the class and what it lacks; empty when all fit.
    """
    found: dict[str, list[str]] = {}
    for mixer in mixers:
        cls = _built_class(mixer)
        adapter = ADAPTERS.get(cls.__name__)
        if adapter is None or cls.__name__ in found:
            continue
        lacks = [name for name in adapter.reads if not hasattr(mixer, name)]
        module = sys.modules.get(cls.__module__)
        if adapter.kernel is not None and not callable(getattr(module, adapter.kernel, None)):
            lacks.append(f"{cls.__module__}.{adapter.kernel}")
        if hub.unreadable_routing(cls):
            lacks.append("the kernel functions its forward routes to hub kernels (kernels' use_kernelized_func)")
        found[cls.__name__] = lacks
    return [f"{name} lacks {', '.join(lacks)}" for name, lacks in sorted(found.items()) if lacks]


def adapt(mixers: tuple[torch.nn.Module, ...]) -> None:
    """Swap each mixer's class for its adapter, in place (Note [mixer adapters]); adapted ones are left as they are.

    Args:
        mixers: token mixers whose classes all have adapters (``unknown_mixers`` is empty).
    """
    for mixer in mixers:
        if type(mixer).__name__ in ADAPTERS:
            mixer.__class__ = _adapter_class(type(mixer))


def implementations(mixers: tuple[torch.nn.Module, ...], device_type: str) -> list[MixerKernel]:
    """What each mixer class's convolution and recurrence run on ``device_type`` (Note [mixer implementations]).

    Args:
        mixers: a model's token mixers other than attention (``ModelAnatomy.mixers``), adapted or not.
        device_type: where the tensors are ("cpu", "cuda", ...).

    Returns:
        One entry per class and step; classes without an adapter are left out.
    """
    by_class: dict[type, list[torch.nn.Module]] = {}
    for mixer in mixers:
        if (cls := _built_class(mixer)).__name__ in ADAPTERS:
            by_class.setdefault(cls, []).append(mixer)
    return mixer_kernels(
        list(by_class),
        lambda cls: (ADAPTERS[cls.__name__].recurrent, ADAPTERS[cls.__name__].kernel),
        device_type,
        lambda cls, function: hub.kernelized(by_class[cls], function),
    )
