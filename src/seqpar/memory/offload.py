"""Checkpoint offload: the hidden state each checkpointed decoder layer keeps goes to host memory and back.

Saved-tensor hooks around each layer's call move it to pinned CPU memory on a side CUDA stream.

Note [checkpoint offload]
    Under non-reentrant activation checkpointing a decoder layer keeps only its inputs for the backward,
    saved as saved tensors outside the checkpoint's own hooks (transformers checkpoints the layer's
    ``forward``, inside ``__call__``, so module hooks stay outside). A forward pre-hook on each layer opens
    ``torch.autograd.graph.saved_tensors_hooks`` and the forward hook closes it, so exactly those inputs
    pass through ``pack``. ``pack`` moves the hidden states (the layer's first argument; position tables
    and masks are shared by all layers and stay) to the host and returns a handle; ``unpack`` brings them
    back when the backward recomputes the layer. Copies are exact, so losses and gradients are unchanged.
    On CUDA, the device-to-host copy runs on a side stream after the compute stream's work so far (the
    forward goes on meanwhile; ``record_stream`` keeps the allocator from reusing the source before the
    copy ends), into pinned memory. In the backward, bringing back layer i's input also starts the copy of
    the layer saved just before it, so that copy overlaps layer i's recomputation and backward; the
    compute stream waits on an event before it uses a copied tensor.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from seqpar.errors import SeqparInputError
from seqpar.models import find_anatomy


class _Saved:
    """One offloaded tensor: its host copy, and its device copy while one is brought back."""

    def __init__(self, host: torch.Tensor, device: torch.device, ready: object, previous: _Saved | None):
        self.host = host
        self.device = device
        self.ready = ready  # CUDA event: the copy to the host has ended (None on the CPU)
        # saved by the layer before (the next one the backward needs); weak, so that a step's copies die
        # with its graph instead of chaining every step's together
        self.previous = weakref.ref(previous) if previous is not None else None
        self.back: torch.Tensor | None = None
        self.back_ready: object = None


class CheckpointOffload:
    """The pack/unpack hooks of checkpoint offload and their per-layer module hooks (Note [checkpoint offload]).

    Tensors on a CUDA device go to pinned host memory through a side stream. Tensors already on the CPU stay,
    unless ``copy_cpu_tensors``: then they are copied to new CPU tensors and back, which saves nothing but
    runs the same hooks (for checking the mechanism without a GPU).
    """

    def __init__(self, *, copy_cpu_tensors: bool = False) -> None:
        self.copy_cpu_tensors = copy_cpu_tensors
        self.offloaded = 0
        """Tensors moved to the host so far."""
        self.offloaded_bytes = 0
        """Bytes moved to the host so far."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._open: list[object | None] = []  # the saved-tensor hooks each open layer call entered
        self._last: _Saved | None = None

    def attach(self, layer: nn.Module) -> list:
        """Register the hooks on one decoder layer; returns their handles (``handle.remove()`` undoes them)."""
        return [
            layer.register_forward_pre_hook(self._enter, with_kwargs=True),
            layer.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        checkpointed = getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not checkpointed or not isinstance(hidden, torch.Tensor):
            self._open.append(None)
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack_for(hidden), self.unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _exit(self, layer: nn.Module, args: tuple, output: object) -> None:
        hooks = self._open.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def pack_for(self, hidden: torch.Tensor):
        """The pack hook of one layer call: offload ``hidden`` when it is saved, keep everything else."""

        def pack(tensor: torch.Tensor) -> object:
            same = (
                tensor.data_ptr() == hidden.data_ptr()
                and tensor.shape == hidden.shape
                and tensor.dtype == hidden.dtype
                and tensor.device == hidden.device
            )
            wanted = same and not isinstance(tensor, nn.Parameter) and (tensor.is_cuda or self.copy_cpu_tensors)
            return self.offload(tensor) if wanted else tensor

        return pack

    def offload(self, tensor: torch.Tensor) -> _Saved:
        """Start copying ``tensor`` to the host; returns the handle ``unpack`` takes."""
        ready = None
        if tensor.is_cuda:
            stream = self._stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                ready = stream.record_event()
            tensor.record_stream(stream)
        else:
            host = tensor.detach().clone()
        self.offloaded += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        self._last = _Saved(host, tensor.device, ready, self._last)
        return self._last

    def unpack(self, saved: object) -> torch.Tensor:
        """The tensor back on its device (kept tensors pass through)."""
        if not isinstance(saved, _Saved):
            return saved
        self._bring_back(saved)
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None:  # overlap the next layer's copy with this layer's backward
            self._bring_back(previous)
        tensor, saved.back = saved.back, None
        if saved.back_ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.back_ready)
        return tensor

    def _bring_back(self, saved: _Saved) -> None:
        if saved.back is not None:
            return
        if saved.device.type != "cuda":
            saved.back = saved.host.to(saved.device, copy=True)
            return
        stream = self._stream(saved.device)
        # allocated on the compute stream, which frees it after waiting for the copy: no record_stream needed
        back = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        stream.wait_stream(torch.cuda.current_stream(saved.device))
        with torch.cuda.stream(stream):
            stream.wait_event(saved.ready)
            back.copy_(saved.host, non_blocking=True)
            saved.back_ready = stream.record_event()
        saved.back = back

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    found = find_anatomy(model)
    if isinstance(found, str):
        raise SeqparInputError(f"found no decoder layers in {type(model).__name__} to offload: {found}")
    layers = list(found.layers)
    if not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        raise SeqparInputError(
            "activation offload moves the inputs that activation checkpointing keeps: enable checkpointing "
            "first (model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), "
            "or --activation-checkpointing in seqpar train)"
        )
    return layers


def offload_layer_inputs(model: nn.Module, *, copy_cpu_tensors: bool = False) -> CheckpointOffload:
    """Install checkpoint offload on every checkpointed decoder layer of ``model``.

    Args:
        model: a transformers model with activation checkpointing enabled.
        copy_cpu_tensors: also copy hidden states that are on the CPU (to new CPU tensors: saves nothing,
            but runs the hooks without a GPU).

    Returns:
        The hooks object (its ``offloaded`` / ``offloaded_bytes`` count what moved).

    Raises:
        SeqparInputError: no decoder layers, or activation checkpointing not enabled on all of them.
    """
    offload = CheckpointOffload(copy_cpu_tensors=copy_cpu_tensors)
    for layer in _checkpointed_layers(model):
        offload.attach(layer)
    return offload


def apply_activation_offload(model: nn.Module) -> bool:
    """Move each checkpointed decoder layer's hidden-state input to pinned CPU memory until its backward.

    Copies overlap compute on a side CUDA stream (Note [checkpoint offload]); losses and gradients are
    unchanged. Needs activation checkpointing (non-reentrant) enabled on the model first. Without CUDA
    there is nothing to move and it does nothing, with a warning. Tensors of a model left on the CPU of a
    machine with CUDA stay where they are.

    Args:
        model: a transformers model with activation checkpointing enabled.

    Returns:
        True when the hooks were installed (CUDA is available), False when it did nothing.

    Raises:
        SeqparInputError: no decoder layers, or activation checkpointing not enabled on all of them.
    """
    _checkpointed_layers(model)  # refuses a model without checkpointing with or without CUDA
    if not torch.cuda.is_available():
        warnings.warn(
            "activation offload does nothing without CUDA: the checkpointed hidden states stay in CPU memory",
            stacklevel=2,
        )
        return False
    # installed while the model may still be on the CPU (seqpar train moves it after building it):
    # hidden states are offloaded only when they are on a CUDA device
    offload_layer_inputs(model)
    return True
