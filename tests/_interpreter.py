"""fla's and mamba_ssm's Triton kernels on CPU under Triton's interpreter, for the fused tier (pytest -m fused): the
harness shims its rank processes install, and counters of the kernels' calls.

Note [interpreted kernels]
    transformers' hybrid modules call dispatchers that use fla (gated DeltaNet, KDA) or mamba_ssm (SSD) for
    tensors on the devices those packages list, else PyTorch (Note [mixer implementations]). Their kernels are
    Triton's, which ``TRITON_INTERPRET=1`` runs on CPU in numpy. Five shims make that work here, none of them a
    change to a kernel: (1) the autotuner keeps each kernel's first config (with several it benchmarks them
    through a GPU driver, and there is none); (2) while a kernel runs, its module's ``range`` yields ints that
    take ``.to(dtype)``, as fla calls it on loop indices (compiled, they are Triton scalars; interpreted, Python
    ints); (3) an empty ``selective_scan_cuda`` (a mamba_ssm built without CUDA still imports it); (4) an inert
    ``torch.cuda.device`` and ``get_device_properties`` (mamba_ssm enters the device of its tensors); (5)
    transformers' private table of the packages' devices gets "cpu", which its decorator reads when a modeling
    module is imported, so ``install`` runs before any is. A process that installed them keeps them: the tier
    runs on freshly spawned ranks (``spawn_ranks``), never on the suite's shared pool.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

PACKAGES = ("triton", "fla", "mamba_ssm")
"""What the fused tier needs installed (scripts/setup_fused.sh)."""


def missing() -> list[str]:
    """The packages of ``PACKAGES`` not installed here."""
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


class _Index(int):
    """A loop index of an interpreted kernel: an int whose ``.to(dtype)`` is itself (shim 2)."""

    def to(self, *args: object, **kwargs: object) -> _Index:
        return self


def _indices(*args: int) -> Iterator[_Index]:
    return (_Index(i) for i in builtins.range(*args))


def install() -> None:
    """Install the shims of Note [interpreted kernels] in this process (again: nothing more happens).

    Raises:
        RuntimeError: a modeling module of transformers was imported before: its dispatchers kept the old devices.
    """
    from transformers.integrations import hub_kernels

    if "cpu" in hub_kernels._PACKAGE_SUPPORTED_DEVICES["fla"]:
        return
    early = [name for name in sys.modules if name.startswith("transformers.models.") and ".modeling_" in name]
    if early:
        raise RuntimeError(f"the interpreter's shims must precede the modeling modules; imported already: {early}")
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: before fla or mamba_ssm is imported
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    patch = interpreter._patch_lang

    def patch_lang(fn: Callable) -> object:
        scope = patch(fn)
        module = sys.modules.get(fn.__module__)
        if module is not None and module.__dict__ is fn.__globals__:
            scope.set_attr(module, "range", _indices)  # undone with the scope's other patches
        return scope

    interpreter._patch_lang = patch_lang
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=4)
    for package in ("fla", "mamba_ssm"):
        hub_kernels._PACKAGE_SUPPORTED_DEVICES[package] += ("cpu",)


@dataclass
class Calls:
    """The calls a kernel's autograd Function got while ``counted`` ran."""

    forward: list[tuple[int, int]] = field(default_factory=list)
    """Per call, the (tokens, width) of its values: ``[n, T, heads, width]``."""
    backward: int = 0
    package: int = 0
    """Calls of the package's function inside the dispatcher."""
    fallback: int = 0
    """Calls of transformers' PyTorch function inside the dispatcher."""


def torch_function(dispatcher: object) -> Callable:
    """transformers' PyTorch function inside its dispatcher ``use_kernel_func_from_hub_with_fallback`` built."""
    return _cell(_wrapper(dispatcher), "torch_function").cell_contents


def _wrapper(dispatcher: object) -> Callable:
    """The function transformers' decorator wrote around the package's and PyTorch's."""
    if isinstance(dispatcher, torch.nn.Module):  # with the ``kernels`` package: a module over that function
        return _cell(type(dispatcher).forward, "func").cell_contents
    return dispatcher


def _cell(function: Callable, name: str) -> types.CellType:
    return function.__closure__[function.__code__.co_freevars.index(name)]


@contextlib.contextmanager
def counted(function: type[torch.autograd.Function], values: int, dispatcher: object) -> Iterator[Calls]:
    """Count the calls of the autograd Function ``function`` (its argument number ``values`` holds the values) and
    of the package's and PyTorch's functions inside transformers' ``dispatcher``, while the block runs.

    The dispatcher itself stays where it is, so that what seqpar reads of it (Note [mixer implementations]) is
    what it reads outside the block; its closure gets counting wrappers of the two functions.

    Args:
        function: the kernel's ``torch.autograd.Function`` class.
        values: the position of its values tensor among ``apply``'s arguments.
        dispatcher: the modeling module's dispatcher of that kernel.

    Returns:
        A context manager yielding the ``Calls``, updated as they happen; everything is put back after.
    """
    calls = Calls()
    own = {key: function.__dict__[key] for key in ("apply", "backward") if key in function.__dict__}
    apply, backward = function.apply, function.backward
    cells = {key: _cell(_wrapper(dispatcher), key) for key in ("implementation", "torch_function")}
    kept = {key: cell.cell_contents for key, cell in cells.items()}

    def forward_counted(*args: object, **kwargs: object) -> object:
        calls.forward.append((args[values].shape[1], args[values].shape[-1]))
        return apply(*args, **kwargs)

    def backward_counted(ctx: object, *grads: object) -> object:
        calls.backward += 1
        return backward(ctx, *grads)

    def counting(key: str, count: str) -> Callable:
        @functools.wraps(kept[key])
        def call(*args: object, **kwargs: object) -> object:
            setattr(calls, count, getattr(calls, count) + 1)
            return kept[key](*args, **kwargs)

        return call

    function.apply, function.backward = forward_counted, staticmethod(backward_counted)
    cells["implementation"].cell_contents = counting("implementation", "package")
    cells["torch_function"].cell_contents = counting("torch_function", "fallback")
    try:
        yield calls
    finally:
        for key in ("apply", "backward"):
            delattr(function, key)
            if key in own:
                setattr(function, key, own[key])
        for key, cell in cells.items():
            cell.cell_contents = kept[key]
