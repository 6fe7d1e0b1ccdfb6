"""Which implementation each adapted mixer's kernels resolve to on a device (a fused package or PyTorch), and why.

``seqpar doctor`` and ``python -m benchmarks.mixers`` print it (Note [mixer implementations]).

Note [mixer implementations]
    transformers' hybrid modules call dispatchers (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
    ``mamba2_chunk_scan``, ``causal_conv1d_fn``) that look up a fused package when their module is imported (fla,
    mamba_ssm, causal_conv1d) and, per call, use it only for tensors on a device it supports, else their PyTorch
    code. seqpar's adapters call the same dispatchers, so a shard runs what one process runs; the dispatcher keeps
    what it found in its closure, which is read here (an unreadable one is reported as "unknown", never guessed).
    The halo convolution takes the model's kernel on rows without packed documents only (Note [halo
    convolution]). Mamba1's scan, RWKV's WKV loop and lightning attention are seqpar's own PyTorch code on every
    device: no fused kernel takes a state in and gives a differentiable one out (Note [Mamba1 state], Note [WKV
    state]). Above both, a kernelized model (``kernelize``, or ``use_kernels``, which transformers'
    ``from_pretrained`` turns on where the ``kernels`` package is installed) runs the hub kernel that ``kernelize``
    gave a layer's wrapper of the dispatcher, seqpar's calls included (Note [hub kernels]): read as "hub", naming
    its repository and the layers that have it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqpar.sequence_parallel.mixers.conv import conv_kernel


@dataclass(frozen=True)
class MixerKernel:
    """One step of an adapted mixer class and the implementation it runs on a device."""

    mixer: str
    """The transformers class."""
    step: str
    """"convolution" or "recurrence"."""
    implementation: str
    """The package that runs it ("fla", "mamba_ssm", "causal_conv1d"), "hub" (a kernel ``kernelize`` installed),
    "torch" (transformers' PyTorch code), "seqpar" (seqpar's own PyTorch code) or "unknown"."""
    why: str

    def line(self) -> str:
        """``Class: step -> implementation (why)``."""
        return f"{self.mixer}: {self.step} -> {self.implementation} ({self.why})"


def _cells(function: Callable) -> dict[str, object]:
    """The free variables of ``function`` by name (empty where it has none)."""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    found = {}
    for name, cell in zip(code.co_freevars if code else (), closure, strict=False):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # a variable not bound yet
            continue
    return found


def _dispatched(dispatcher: object, device_type: str) -> tuple[str, str]:
    """(implementation, why) of transformers' ``use_kernel_func_from_hub_with_fallback`` dispatcher on a device."""
    # with the ``kernels`` package, the dispatcher is a module whose forward closes over transformers' function
    function = _cells(type(dispatcher).forward).get("func") if isinstance(dispatcher, torch.nn.Module) else dispatcher
    cells = _cells(function) if callable(function) else {}
    if not {"implementation", "torch_function", "package"} <= cells.keys():
        return "unknown", "transformers' dispatcher is not one seqpar can read"
    package, devices = str(cells["package"]), cells.get("supported_devices")
    if cells["implementation"] is cells["torch_function"]:
        return "torch", f"{package} is not installed"
    if devices is not None and device_type not in devices:
        return "torch", f"{package} runs on {', '.join(devices)} tensors, these are on {device_type}"
    return package, "installed, and runs on this device"


VARLEN_PACKAGES = ("fla",)
"""The packages whose recurrence kernels take ``cu_seqlens`` with one initial and one differentiable final state per
sequence (Note [state passing]); mamba_ssm's per-sequence final states have no backward, PyTorch's take no
``cu_seqlens``."""


def takes_varlen(dispatcher: object, device_type: str) -> bool:
    """Whether transformers' dispatcher runs a package of ``VARLEN_PACKAGES`` on ``device_type`` tensors."""
    return _dispatched(dispatcher, device_type)[0] in VARLEN_PACKAGES


def mixer_kernels(
    classes: list[type],
    recurrence: Callable[[type], tuple[bool, str | None]],
    device_type: str,
    kernelized: Callable[[type, object], str | None] = lambda cls, dispatcher: None,
) -> list[MixerKernel]:
    """What each mixer class's convolution and recurrence run on ``device_type`` (Note [mixer implementations]).

    Args:
        classes: the transformers mixer classes, each once.
        recurrence: a class -> whether it has a recurrence, and the name of its module's dispatcher that the
            adapter calls for it, or None where the adapter runs its own (``MixerAdapter``).
        device_type: where the tensors are ("cpu", "cuda", ...).
        kernelized: a class and one of its module's dispatchers -> where its layers run a hub kernel in the
            dispatcher's place, or None where none does (Note [hub kernels]).

    Returns:
        One entry per class and step, in the order of ``classes``.
    """

    def step(cls: type, name: str, dispatcher: object, packed: str = "") -> MixerKernel:
        hub = kernelized(cls, dispatcher)
        implementation, why = ("hub", hub) if hub is not None else _dispatched(dispatcher, device_type)
        return MixerKernel(cls.__name__, name, implementation, why + packed)

    rows = []
    for cls in classes:
        conv = conv_kernel(cls)
        if conv is not None:
            rows.append(step(cls, "convolution", conv, "; packed rows: seqpar's taps"))
        recurrent, name = recurrence(cls)
        if not recurrent:
            continue
        dispatcher = getattr(sys.modules.get(cls.__module__), name, None) if name else None
        if dispatcher is None:
            rows.append(MixerKernel(cls.__name__, "recurrence", "seqpar", "no fused kernel passes its state"))
        else:
            rows.append(step(cls, "recurrence", dispatcher))
    return rows
