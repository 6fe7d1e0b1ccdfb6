"""Tiled MLP: a decoder MLP run over chunks of tokens, recomputed chunk by chunk in the backward.

Only one chunk's ``[chunk, intermediate]`` activations exist at a time, in the forward and in the backward.

Note [tiled MLP]
    A decoder MLP acts on every token alone, so running it on consecutive chunks of the flattened
    ``[tokens, hidden]`` input and writing the chunks' outputs side by side gives the same output. The
    tiled forward is one autograd Function over all chunks: its forward runs the chunks without a graph
    and keeps only the input; its backward runs each chunk again with a graph, takes that chunk's input
    and parameter gradients with ``torch.autograd.grad``, writes the input gradient into its rows and adds
    the parameter gradients up. The summed parameter gradients are returned from the Function, so autograd
    adds them to ``.grad`` once per backward, as for the untiled MLP: DDP's and FSDP2's gradient hooks see
    one gradient per parameter. The only differences from the untiled MLP are the order in which the
    chunks' parameter gradients are summed (float rounding) and one more MLP forward per backward.
    The recomputation uses the module's parameters as they are at backward time (FSDP2 unshards them again
    before the backward) and the autocast state of the forward. Modules whose result for a token may
    depend on other tokens or on random numbers (batch norm, convolutions, attention, dropout) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from seqpar.errors import SeqparInputError
from seqpar.models import find_anatomy

# leaf modules known to act on each token alone (element-wise, or along the last dimension only)
_TOKENWISE = (nn.Linear, nn.Identity, nn.LayerNorm, nn.RMSNorm)
_TOKEN_MIXING_ACTIVATIONS = ("MultiheadAttention", "Softmax2d")
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _leaf_is_tokenwise(module: nn.Module) -> bool:
    kind = type(module)
    if isinstance(module, _TOKENWISE):
        return True
    if isinstance(module, _DROPOUTS):
        return module.p == 0
    if kind.__module__ == "torch.nn.modules.activation":
        # softmax-like activations are per token only along the last dimension
        return kind.__name__ not in _TOKEN_MIXING_ACTIVATIONS and getattr(module, "dim", -1) in (-1, None)
    if kind.__module__ == "transformers.activations":
        return True
    return kind.__module__ == "transformers.pytorch_utils" and kind.__name__ == "Conv1D"


def _check_tileable(name: str, module: nn.Module) -> None:
    """Raise unless every leaf below ``module`` is known to act on each token alone."""
    for sub_name, sub in module.named_modules():
        if next(sub.children(), None) is None and not _leaf_is_tokenwise(sub):
            where = f"{name}.{sub_name}" if sub_name else name
            raise SeqparInputError(
                f"cannot tile the MLP {name} ({type(module).__name__}): its part {where} ({type(sub).__name__}) "
                "is not known to act on each token alone (token-mixing, sequence statistics or randomness); "
                "only Linear layers, element-wise activations, layer norms and dropout with p=0 can be tiled"
            )


class _Tiled:
    """The forward put on a tiled module: the module's own forward, run over chunks of tokens."""

    def __init__(self, module: nn.Module, name: str, forward: object, chunk_tokens: int):
        self.module = module
        self.name = name
        self.forward = forward
        self.chunk_tokens = chunk_tokens

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        values = [*args, *kwargs.values()]
        if len(values) != 1 or not isinstance(values[0], torch.Tensor):
            raise SeqparInputError(
                f"the tiled MLP {self.name} takes one tensor of hidden states, got "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        x = values[0]
        flat = x.reshape(-1, x.shape[-1])
        params = list(self.module.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            out = _TiledFunction.apply(self, max(x.dim(), 2), flat, *params)
        else:
            out = self.run_chunks(flat, max(x.dim(), 2))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def run_chunks(self, flat: torch.Tensor, ndim: int) -> torch.Tensor:
        """The module's output for ``flat`` ([tokens, hidden]), computed a chunk of tokens at a time."""
        if flat.shape[0] == 0:
            return self.run(flat, ndim)
        out = None
        for start in range(0, flat.shape[0], self.chunk_tokens):
            piece = self.run(flat[start : start + self.chunk_tokens], ndim)
            if out is None:  # dtype and width from the first chunk (autocast may change the dtype)
                out = piece.new_empty(flat.shape[0], piece.shape[-1])
            out[start : start + piece.shape[0]] = piece
        return out

    def run(self, piece: torch.Tensor, ndim: int) -> torch.Tensor:
        """The module on one chunk ``[tokens, hidden]``, shown as a batch of one with the input's rank."""
        y = self.forward(piece.view(*[1] * (ndim - 2), *piece.shape))
        if not isinstance(y, torch.Tensor) or y.shape[:-1].numel() != piece.shape[0] or y.dim() != ndim:
            got = type(y).__name__ if not isinstance(y, torch.Tensor) else f"a tensor of shape {tuple(y.shape)}"
            raise SeqparInputError(
                f"cannot tile the MLP {self.name}: for {piece.shape[0]} tokens it returned {got}, not one "
                "tensor with a row per token (mixture-of-experts blocks returning router outputs are not tiled)"
            )
        return y.reshape(piece.shape[0], y.shape[-1])


class _TiledFunction(torch.autograd.Function):
    """Forward over chunks without a graph; backward recomputes one chunk at a time (Note [tiled MLP])."""

    @staticmethod
    def forward(ctx, tiled: _Tiled, ndim: int, flat: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        device = flat.device.type
        ctx.tiled, ctx.ndim = tiled, ndim
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(flat)
        return tiled.run_chunks(flat, ndim)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        (flat,) = ctx.saved_tensors
        tiled: _Tiled = ctx.tiled
        need_x, need_params = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        wanted = [i for i, need in enumerate(need_params) if need]
        grad_x = torch.empty_like(flat) if need_x else None
        param_grads: list[torch.Tensor | None] = [None] * len(need_params)
        device, enabled, dtype = ctx.autocast
        with (
            torch.enable_grad(),
            torch.autocast(device, dtype=dtype, enabled=enabled),
            _stand_ins(tiled.module) as params,
        ):
            wanted_params = [params[i] for i in wanted]
            for start in range(0, flat.shape[0], tiled.chunk_tokens):
                piece = flat[start : start + tiled.chunk_tokens].detach().requires_grad_(need_x)
                y = tiled.run(piece, ctx.ndim)
                inputs = [piece, *wanted_params] if need_x else wanted_params
                found = torch.autograd.grad(y, inputs, grad_out[start : start + piece.shape[0]], allow_unused=True)
                if need_x:
                    grad_x[start : start + piece.shape[0]] = found[0]
                    found = found[1:]  # drop the chunk's input gradient now, not after the next chunk's backward
                for i, g in zip(wanted, found, strict=True):
                    if g is not None:
                        param_grads[i] = g if param_grads[i] is None else param_grads[i].add_(g)
        return (None, None, grad_x, *param_grads)


@contextlib.contextmanager
def _stand_ins(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Put detached aliases of ``module``'s parameters in their places (in ``parameters()`` order) for a while.

    The recomputation differentiates with respect to the aliases: hooks registered on the parameters
    themselves (DDP's gradient scaling, for one) would otherwise run for every chunk, and once more when the
    summed gradient reaches the parameter. The parameters are taken as they are now (FSDP2 has unsharded them
    again for the backward).
    """
    slots = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items() if p is not None]
    aliases: dict[int, torch.Tensor] = {}
    for _, _, p in slots:
        if id(p) not in aliases:
            aliases[id(p)] = p.detach().requires_grad_(p.requires_grad)
    try:
        for owner, name, p in slots:
            owner._parameters[name] = aliases[id(p)]
        yield list(aliases.values())
    finally:
        for owner, name, p in slots:
            owner._parameters[name] = p


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward is the tiled one (``tiled_mlp`` or ``apply_tiled_mlp`` ran on it)."""
    return isinstance(module.__dict__.get("forward"), _Tiled)


def tiled_mlp(module: nn.Module, chunk_tokens: int = 1024, *, name: str | None = None) -> nn.Module:
    """Make ``module`` (an MLP acting on each token alone) run over chunks of ``chunk_tokens`` tokens.

    The module keeps its parameters, names and state dict; only its forward changes (Note [tiled MLP]).
    Applying it again changes the chunk size.

    Args:
        module: the MLP; called with one tensor ``[..., hidden]`` and returning one ``[..., out]`` tensor.
        chunk_tokens: tokens per chunk (over the flattened leading dimensions, batch included).
        name: how errors name the module (default: its class name).

    Returns:
        The same module, tiled.

    Raises:
        SeqparInputError: a chunk size below 1, or a module with parts that may mix tokens or draw random
            numbers (batch norm, convolutions, attention, dropout with p > 0).
    """
    name = name or type(module).__name__
    _check_chunk(chunk_tokens)
    _check_tileable(name, module)
    current = module.__dict__.get("forward")
    forward = current.forward if isinstance(current, _Tiled) else module.forward
    module.forward = _Tiled(module, name, forward, chunk_tokens)
    return module


def _check_chunk(chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise SeqparInputError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens!r}")


def apply_tiled_mlp(model: nn.Module, *, chunk_tokens: int = 1024, modules: Iterable[nn.Module] | None = None) -> int:
    """Tile every decoder MLP of ``model`` (or the given ``modules``) over chunks of tokens.

    Without ``modules``, the decoder MLPs of the model's family are tiled (``seqpar.models.anatomy``): the
    gated MLPs of Llama, Qwen2/3, Mistral, Gemma/Gemma 3 (gate, up and down projections) and Phi-3's fused
    gate-up projection; mixtures of experts are refused by name. Composes with activation checkpointing,
    ``seqpar.prepare_model`` and ``seqpar.apply_data_parallel`` (Note [tiled MLP]).

    Args:
        model: the model (used for the names in errors when ``modules`` is given).
        chunk_tokens: tokens per chunk, over the flattened batch and sequence of this rank's shard.
        modules: MLP modules to tile instead of the family's decoder MLPs (plain PyTorch MLPs).

    Returns:
        How many MLPs were tiled.

    Raises:
        SeqparInputError: nothing to tile, a module that cannot be tiled (named in the message), or a chunk
            size below 1; checked for every module before any is changed.
    """
    if modules is None:
        found = find_anatomy(model)
        if isinstance(found, str):
            raise SeqparInputError(
                f"found no decoder MLP in {type(model).__name__} ({found}); pass modules=[...] to tile other MLPs"
            )
        targets = [(found.name(m), m) for m in found.mlps]
    else:
        names = {id(m): n for n, m in model.named_modules()}
        targets = [(names.get(id(m), type(m).__name__), m) for m in modules]
        if not targets:
            raise SeqparInputError("modules= is empty: nothing to tile")
    _check_chunk(chunk_tokens)
    for name, module in targets:  # all checked before any is changed
        _check_tileable(name, module)
    for name, module in targets:
        tiled_mlp(module, chunk_tokens, name=name)
    return len(targets)
