"""Hub kernels (``kernels``' ``kernelize``, transformers' ``use_kernels``) kept under seqpar's mixer adapters.

The adapter's ``forward`` runs under the routing of the class it replaces, and ``seqpar doctor`` names a hub kernel.

Note [hub kernels]
    transformers decorates its hybrid mixer classes with ``kernels``' ``use_kernelized_func(f, ...)``: each
    instance gets private wrappers of the module-level kernel functions ``f`` (in ``_kernel_funcs``), and the
    class's ``forward`` is wrapped to route a call of ``f`` made while it runs to the instance's wrapper, whose
    ``forward`` ``kernelize`` replaces with the hub's kernel. The adapter overrides ``forward``, so it is wrapped
    the same way, by the same decorator over the same functions: the calls seqpar's ``forward`` makes of
    ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention`` or ``mamba2_chunk_scan``
    reach the hub's kernel wherever one process's would (``tests/test_hub_kernels.py``). The decorator keeps its
    functions only in the wrapper's closure, read in one place (``_routed_functions``); a wrapper whose functions
    cannot be read there (another ``kernels``) is refused by ``prepare_model``, not left to lose its kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["adapter_class", "kernelized", "unreadable_routing"]


@functools.cache
def _wrapper_code() -> object | None:
    """The code of the ``forward`` that ``kernels``' ``use_kernelized_func`` makes (None without ``kernels``)."""
    try:
        from kernels import use_kernelized_func
    except ImportError:  # without kernels, transformers' decorator leaves the class as it is
        return None
    probe = use_kernelized_func()(type("Probe", (torch.nn.Module,), {"forward": lambda self: None}))
    return probe.forward.__code__


def _routed_functions(cls: type) -> tuple[object, ...] | None:
    """The kernel functions that ``cls.forward`` routes to each instance's wrappers: empty where it is no
    ``use_kernelized_func`` wrapper, None where it is one whose functions cannot be read."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or code is not _wrapper_code():
        return ()
    # kernels 0.19's wrapper keeps the decorator's arguments only in its closure (``decorator_args``); this is the
    # one place seqpar reads a private name of kernels
    cells = dict(zip(code.co_freevars, forward.__closure__ or (), strict=False))
    found = cells.get("decorator_args")
    return tuple(found.cell_contents) if found is not None else None


def unreadable_routing(cls: type) -> bool:
    """Whether ``cls.forward`` routes hub kernels in a way seqpar cannot keep (Note [hub kernels])."""
    return _routed_functions(cls) is None


def adapter_class(cls: type, forward: Callable[..., object], module: str) -> type:
    """The subclass of ``cls`` whose ``forward`` is ``forward``, under ``cls``'s routing of hub kernels if any.

    Args:
        cls: a transformers mixer class (``unreadable_routing`` false).
        forward: seqpar's ``forward`` for it.
        module: the ``__module__`` of the subclass.

    Returns:
        The subclass, named ``Seqpar`` and the class's name.
    """
    adapter = type(f"Seqpar{cls.__name__}", (cls,), {"forward": forward, "__module__": module})
    functions = _routed_functions(cls)
    if functions:
        from kernels import use_kernelized_func

        use_kernelized_func(*functions)(adapter)
        # the decorator also wraps ``__init__`` to make each instance's wrappers; an adapted instance was built by
        # ``cls``, which made them, and only takes the adapter as its class
        del adapter.__init__
    return adapter


def kernelized(mixers: list[torch.nn.Module], function: object) -> str | None:
    """Where ``kernelize`` gave the wrappers of ``function`` in ``mixers`` a hub kernel, and on how many of them.

    Args:
        mixers: the mixers of one class.
        function: a kernel function of the class's module (a ``kernels`` function module).

    Returns:
        The repository (or repositories) and the count, as ``seqpar doctor`` says them; None where none was.
    """
    try:
        from kernels import get_kernelized_layers
    except ImportError:
        return None
    repos = [
        str(found.repo)
        for mixer in mixers
        for (name, _), found in get_kernelized_layers(mixer).funcs.items()
        if not name and type(found.module) is type(function)  # the mixer's own wrapper of this very function
    ]
    if not repos:
        return None
    return f"kernelized from {', '.join(dict.fromkeys(repos))} in {len(repos)} of {len(mixers)} layers"
