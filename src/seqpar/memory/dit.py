"""Per-rank memory of a diffusers transformer's (a DiT's) sequence-parallel training step, from traced small runs.

``profile_dit_memory`` traces what the model keeps for its backward at two small token counts;
``estimate_dit_memory`` scales that to a clip's tokens and a sequence-parallel degree.

Note [DiT memory]
    A DiT's layers differ by class (Wan's cross-attention, CogVideoX's and HunyuanVideo's joint streams,
    Flux's single-stream blocks, per-class norms and modulations), so instead of a formula per class the
    estimate measures the model itself: one forward and the loss on the CPU, in one process, at two small
    clip sizes, with ``saved_tensors_hooks`` counting the bytes of every distinct tensor autograd keeps
    (parameters excluded), split into the bytes saved where the tokens are cut (from the first block,
    the parent of the plan's first self-attention module, through the module whose output the plan
    gathers: Wan's blocks, output norm and projection) and outside (patchify, embeddings, the loss).
    Both grow linearly with the latent tokens when attention keeps only its inputs, output and
    log-sum-exp (the CPU and GPU flash kernels, and seqpar's kernels, do), so two sizes give each a fixed
    part and a part per token. A sequence-parallel rank runs the cut part on 1/P of the tokens (the text
    too, in joint attention) while patchify, the embeddings and the gathered prediction stay whole (Note
    [diffusers door]); so a rank keeps ``cut / P + outside``. The step's growth (what it adds to the
    parameters and optimizer state that live between steps) adds the gradients, created during the
    backward, and the attention's exchange buffers (each strategy row's ``buffer_bytes``): ring holds a second
    key/value block in flight (``2 x 2 x S/P x width``), all-gather the gathered keys and values (``2 x S x
    width``), Ulysses its all-to-all's send and receive buffers of them (``2 x 2 x S/P x width``). Not
    modelled: transient buffers of one block's backward (a few ``S/P x width`` tensors), allocator caching,
    and attention kernels that keep the ``S x S`` weights (the math kernel, chosen on the meta device and for
    some masks): the profile is traced with the kernel the CPU picks, so it states what that kernel keeps.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqpar.errors import SeqparInputError
from seqpar.integrations.diffusion import resolve_plan
from seqpar.sequence_parallel.strategies.registry import strategy_row

MiB = 2**20


@dataclass(frozen=True)
class DitMemoryProfile:
    """What one process keeps for the backward of one DiT forward, as a fixed part plus a part per latent token."""

    blocks_per_token: float
    """Bytes kept inside the blocks per latent token (all blocks together)."""
    blocks_fixed: float
    """Bytes kept inside the blocks that do not grow with the tokens (cross-attention's text keys and values)."""
    outside_per_token: float
    """Bytes kept outside the blocks per latent token (patchify, the output projection, the loss)."""
    outside_fixed: float
    """Bytes kept outside the blocks that do not grow with the tokens (text and time embeddings)."""
    parameter_bytes: int
    """Bytes of the model's parameters (their gradients are as large)."""
    width: int
    """Width of one self-attention's keys (heads x head size), for the exchange buffers."""
    traced_tokens: tuple[int, int]
    """The two latent token counts traced."""


@dataclass(frozen=True)
class DitMemoryEstimate:
    """One rank's bytes in one training step of a DiT (Note [DiT memory])."""

    tokens: int
    """Latent tokens of the whole clip."""
    sp_size: int
    """Sequence-parallel degree."""
    kept_blocks: int
    """Activations the blocks keep for the backward on this rank (1/P of the tokens)."""
    kept_outside: int
    """Activations kept outside the blocks (whole on every rank)."""
    gradients: int
    """Parameter gradients, created during the backward."""
    communication: int
    """The attention's exchange buffers (``strategy``)."""
    parameters: int
    """Parameters (live between steps; not part of ``step_growth``)."""

    @property
    def step_growth(self) -> int:
        """Bytes one step adds to what lives between steps (parameters and optimizer state)."""
        return self.kept_blocks + self.kept_outside + self.gradients + self.communication


def _matching(model: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    parts = pattern.split(".")
    return [
        m
        for n, m in model.named_modules()
        if n and len(n.split(".")) == len(parts) and all(map(fnmatch.fnmatchcase, n.split("."), parts))
    ] or ([model.get_submodule(pattern)] if "*" not in pattern else [])


def _kept(model: torch.nn.Module, make_inputs: Callable[[int], tuple[dict, torch.Tensor]], tokens: int) -> tuple:
    """(bytes kept from the first block through the gathered module, the rest) by one forward and MSE loss."""
    plan, _, gathers = resolve_plan(model)
    if plan.derived:
        raise SeqparInputError(
            f"{type(model).__name__} runs on an entry derived from diffusers' _cp_plan, which names no blocks to "
            "profile; the DiT memory estimate covers the classes of seqpar.models.DIFFUSION_PLANS"
        )
    blocks = _matching(model, ".".join(plan.self_attention.split(".")[:-1]))  # they hold the self-attention
    gathered = [m for pattern in gathers for m in _matching(model, pattern)]
    if not blocks or not gathered:
        raise SeqparInputError(f"{type(model).__name__}'s plan names no blocks or no gathered output to profile")
    sharded, seen, counts = [False], set(), [0, 0]
    seen |= {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:  # views of one tensor and tensors saved twice count once
            seen.add(key)
            counts[0 if sharded[0] else 1] += storage.nbytes()
        return t

    def enter(*_):
        sharded[0] = True

    def leave(*_):
        sharded[0] = False

    handles = [blocks[0].register_forward_pre_hook(enter), *(m.register_forward_hook(leave) for m in gathered)]
    inputs, target = make_inputs(tokens)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pred = model(**inputs, return_dict=False)[0]
            F.mse_loss(pred, target)
    finally:
        for handle in handles:
            handle.remove()
    return counts[0], counts[1]


def profile_dit_memory(
    model: torch.nn.Module,
    make_inputs: Callable[[int], tuple[dict, torch.Tensor]],
    tokens: tuple[int, int] = (512, 2048),
) -> DitMemoryProfile:
    """Trace what one process keeps for the backward at two clip sizes (Note [DiT memory]).

    Args:
        model: a diffusers transformer with an entry in ``seqpar.models.DIFFUSION_PLANS``, on the CPU, not
            prepared (one process).
        make_inputs: latent tokens -> (the model's keyword arguments, the regression target of its output).
        tokens: two latent token counts to trace (small: the runs are real).

    Returns:
        The profile: fixed and per-token bytes inside and outside the blocks, parameters, attention width.

    Raises:
        SeqparInputError: a model class without a plan, or equal token counts.
    """
    small, large = tokens
    if small == large:
        raise SeqparInputError(f"profile_dit_memory needs two different token counts, got {tokens}")
    (b0, o0), (b1, o1) = (_kept(model, make_inputs, n) for n in (small, large))
    blocks_slope, outside_slope = (b1 - b0) / (large - small), (o1 - o0) / (large - small)
    attention = next(m for n, m in model.named_modules() if hasattr(m, "to_k") and hasattr(m.to_k, "out_features"))
    return DitMemoryProfile(
        blocks_per_token=blocks_slope,
        blocks_fixed=max(0.0, b0 - blocks_slope * small),
        outside_per_token=outside_slope,
        outside_fixed=max(0.0, o0 - outside_slope * small),
        parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        width=attention.to_k.out_features,
        traced_tokens=(small, large),
    )


def estimate_dit_memory(
    profile: DitMemoryProfile, tokens: int, sp_size: int = 1, strategy: str = "ring", element_size: int = 4
) -> DitMemoryEstimate:
    """One rank's bytes in one training step at ``tokens`` latent tokens over ``sp_size`` ranks (Note [DiT memory]).

    Args:
        profile: from ``profile_dit_memory`` on the same model.
        tokens: latent tokens of the whole clip.
        sp_size: sequence-parallel degree.
        strategy: a strategy row's name ("ring", "allgather", "ulysses", "hybrid"): its exchange buffers.
        element_size: bytes per element of the keys and values.

    Returns:
        The estimate; ``step_growth`` is what the step adds to the memory that lives between steps.

    Raises:
        SeqparInputError: a degree below 1, tokens that do not divide over the degree, an unknown strategy.
    """
    row = strategy_row(strategy)
    if sp_size < 1 or tokens % sp_size:
        raise SeqparInputError(f"{tokens} latent tokens do not divide over sp {sp_size}")
    local = tokens // sp_size
    communication = row.buffer_bytes(local, sp_size, 2 * profile.width * element_size)  # a token's key and value
    return DitMemoryEstimate(
        tokens=tokens,
        sp_size=sp_size,
        kept_blocks=int((profile.blocks_fixed + profile.blocks_per_token * tokens) / sp_size),
        kept_outside=int(profile.outside_fixed + profile.outside_per_token * tokens),
        gradients=profile.parameter_bytes,
        communication=communication,
        parameters=profile.parameter_bytes,
    )
