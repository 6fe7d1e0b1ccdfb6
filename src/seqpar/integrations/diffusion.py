"""Diffusers transformers (video and image DiTs) trained sequence-parallel, exactly: ``prepare_diffusers``.

The latent tokens are cut after patchify, self-attention runs through seqpar, the output is gathered whole.

Note [diffusers door]
    ``prepare_diffusers`` reads the model's entry in ``seqpar.models.DIFFUSION_PLANS`` (and diffusers'
    ``_cp_plan`` where the class declares one; Note [diffusion plans]) and installs documented
    ``nn.Module`` hooks only: forward pre-hooks that cut the planned inputs with ``seqpar.shard_sequence``
    (the tokens before the first block, the per-token timesteps), forward hooks that cut planned outputs
    (the RoPE tables of the global frame x height x width grid) and gather others (the output projection),
    and, on each self-attention module, a pair of hooks that puts a ``SequenceParallelSDPA`` mode on the
    stack for that call alone, so the module's own processor runs unchanged and its one
    ``scaled_dot_product_attention`` call becomes ``seqpar.attention`` (non-causal, every strategy and
    layout). Cross-attention modules get no hook: their queries are this rank's tokens and their keys the
    whole text, which every rank holds, so they move no bytes. A model-level pre-hook, first of all, checks
    the call on every rank at once (Note [agreeing on errors]): each argument's shape and a digest of its
    bytes, so latents, noise, timesteps or text that differ between ranks raise on all of them before
    the first collective.

Note [replicated output]
    The gathered prediction is the same on every rank, and so is the loss computed from it (its target
    included: check it with ``check_replicated``). The gather's backward therefore hands each rank the
    gradient of its own tokens only, not the sum over ranks of ``gather_sequence``: each rank backpropagates
    its share of one loss, and ``seqpar.reduce_gradients`` (a sum over the group) gives one process's
    gradients. Averaging them instead, as DDP over these ranks would, is 1/P off.
"""

from __future__ import annotations

import fnmatch
import inspect
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.integrations._diffusion_attention import (
    WHERE,
    GatherShare,
    Region,
    attention_hooks,
    attention_modules,
    judgement,
    region_hooks,
    says_cross,
    tail_hooks,
)
from seqpar.integrations._diffusion_cuts import STREAMS, cut, cut_any, cut_token_tables
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.models.diffusion import (
    DIFFUSION_PLANS,
    DIFFUSION_REFUSALS,
    DIFFUSION_TAILS,
    DiffusionPlan,
    FoldedSplit,
    Gather,
    Split,
    TokenTables,
)
from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, collective_device
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS, gather_sequence, shard_sequence
from seqpar.sequence_parallel.strategies.registry import check_strategy_name

_HOOKS_ATTR = "_seqpar_diffusion_hooks"
_MAX_DIMS = 6  # dimensions of an argument the ranks compare (a video latent has 5)
_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout)


def _digest(value: object) -> list[int]:
    """Integers equal on ranks whose values are equal: the shape and a position-weighted sum of the bytes."""
    if not isinstance(value, torch.Tensor):  # a plain value by its repr; an object by its type (reprs hold addresses)
        plain = value is None or isinstance(value, (bool, int, float, str))
        told = repr(value) if plain else type(value).__qualname__
        return [value is not None, -1, *[0] * _MAX_DIMS, zlib.crc32(told.encode()), 0]
    flat = value.detach().contiguous().reshape(-1)
    flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat
    words = flat.view(torch.uint8)
    words = (words.view(torch.int32) if words.numel() % 4 == 0 else words).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    dims = [*value.shape, *[0] * _MAX_DIMS][:_MAX_DIMS]
    # int64 sums wrap around the same way on every rank
    return [1, value.dim(), *dims, int(words.sum()), int((words * weights).sum())]


_SAME_DRAWS = "draw noise and timesteps from the same seed on every rank"
_SAME_WEIGHTS = "load or initialise the weights alike on every rank (torch.manual_seed before building the model)"


def _agree(named: dict[str, object], group: dist.ProcessGroup | None, what: str, hint: str = _SAME_DRAWS) -> None:
    """Raise the same ``SeqparInputError`` on every rank if the ranks hold different ``named`` values.

    Two small all-gathers (Note [agreeing on errors]): the names first (ranks that name different values get
    the same error, not rows of different widths), then a few integers per value.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    names = sorted(named)
    device = collective_device(group)
    header = torch.tensor([[len(names), zlib.crc32("\0".join(names).encode())]], dtype=torch.int64, device=device)
    headers = all_gather_first_dim(header, group).tolist()
    if any(h != headers[0] for h in headers):
        raise SeqparInputError(
            f"{WHERE}: the ranks passed different sets of {what} (this rank: {', '.join(names)}); every rank of the "
            "sequence-parallel group must pass the same arguments"
        )
    mine = torch.tensor([_digest(named[n]) for n in names], dtype=torch.int64, device=device)
    rows = all_gather_first_dim(mine[None], group).tolist()  # [P][names][digest]
    differ = [i for i in range(len(names)) if any(row[i] != rows[0][i] for row in rows)]
    if differ:

        def shape(digest: list[int]) -> str:
            return "no value" if not digest[0] else str(digest[2 : 2 + digest[1]]) if digest[1] >= 0 else "a value"

        told = "; ".join(
            f"{names[i]}: " + ", ".join(f"rank {r} {shape(row[i])}" for r, row in enumerate(rows)) for i in differ
        )
        raise SeqparInputError(
            f"{WHERE}: {what} differ across the sequence-parallel ranks ({', '.join(names[i] for i in differ)}); "
            f"every rank of the group must hold the same values ({hint}): {told}"
        )


def check_replicated(mesh: object, **tensors: object) -> None:
    """Check that every rank of the sequence-parallel group holds the same values (the loss target, the noise).

    The door checks the model's own arguments at every call; the loss's other inputs (the flow-matching
    target ``noise - latents``) must agree too (Note [replicated output]).

    Args:
        mesh: the mesh (or SP process group) the model was prepared with.
        **tensors: named tensors (or plain values) to compare; every rank passes the same names.

    Raises:
        SeqparInputError: on every rank, naming the values that differ and their shapes on each rank.
    """
    _agree(tensors, as_sp_mesh(mesh).sp_group, "values")


class _ReplicatedGather(torch.autograd.Function):
    """All-gather of the sequence whose backward keeps this rank's own tokens (Note [replicated output]), of the
    gradient summed over the group where the forward goes on past it (Note [gathered tail])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelMesh, dim: int, layout: str, share: GatherShare):
        ctx.sp, ctx.dim, ctx.layout, ctx.share = sp, dim, layout, share
        with torch.no_grad():
            return gather_sequence(x, sp, dim=dim, layout=layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.share.summed:  # read at the backward: the forward's end decides it (Note [gathered tail])
            grad = grad.clone(memory_format=torch.contiguous_format)  # one copy: the all-reduce writes it
            dist.all_reduce(grad, group=ctx.sp.sp_group)
        return shard_sequence(grad, ctx.sp, dim=ctx.dim, layout=ctx.layout).contiguous(), None, None, None, None


def _split_of(entry: object) -> Split | tuple[Split, ...]:
    """seqpar's ``Split`` for one of diffusers' ``ContextParallelInput`` (or a list of them, for a tuple)."""
    if isinstance(entry, (list, tuple)):
        return tuple(_split_of(e) for e in entry)
    return Split(entry.split_dim, entry.expected_dims, bool(entry.split_output))


def _read_cp_plan(model: torch.nn.Module) -> tuple[dict, dict]:
    """``(shards, gathers)`` from the model's diffusers ``_cp_plan`` (Note [diffusion plans])."""
    cp_plan = getattr(model, "_cp_plan", None)
    if not cp_plan:
        raise SeqparInputError(
            f"{WHERE}: the seqpar plan of {type(model).__name__} reads diffusers' _cp_plan, but the class declares "
            "none; register a plan with shards and gathers (seqpar.models.register_diffusion_plan)"
        )
    shards, gathers = {}, {}
    for name, entry in cp_plan.items():
        if isinstance(entry, dict):
            shards[name] = {key: _split_of(value) for key, value in entry.items()}
        else:
            outputs = entry if isinstance(entry, (list, tuple)) else [entry]
            gathers[name] = tuple(None if o is None else Gather(o.gather_dim, o.expected_dims) for o in outputs)
    return shards, gathers


def resolve_plan(model: torch.nn.Module) -> tuple[DiffusionPlan, dict, dict]:
    """The model's entry with its shards and gathers resolved (``_cp_plan`` read where the entry defers to it).

    Args:
        model: a diffusers transformer.

    Returns:
        ``(plan, shards, gathers)``: the entry, module pattern -> cuts, module pattern -> gathered outputs.

    Raises:
        SeqparInputError: a class without an entry (naming it and the classes served), or refused by name.
    """
    name = type(model).__name__
    plan = DIFFUSION_PLANS.get(name)
    if plan is None and name in DIFFUSION_REFUSALS:  # the refusal's reason, not the want of a plan
        raise SeqparInputError(
            f"{WHERE}: seqpar cannot serve {name} exactly: the model is a {name}: {DIFFUSION_REFUSALS[name]}"
        )
    if plan is None and getattr(model, "_cp_plan", None):
        plan = DiffusionPlan(name, self_attention="", derived=True, notes=("diffusers' _cp_plan, derived",))
    if plan is None:
        plan = _structural_plan(model)
    if plan is None:
        raise SeqparInputError(
            f"{WHERE}: seqpar has no sequence-parallel plan for {name} and cannot derive one (it declares no "
            "diffusers _cp_plan, and is not built as one list of blocks taking hidden_states followed by an output "
            "projection); it serves "
            f"{', '.join(sorted(DIFFUSION_PLANS))} and the classes it derives a plan for "
            "(seqpar.models.register_diffusion_plan adds one: where to cut the tokens, gather the output, and which "
            "modules attend over the tokens or to the text)"
        )
    if plan.shards is None or plan.gathers is None:
        shards, gathers = _read_cp_plan(model)
    else:
        shards, gathers = dict(plan.shards), dict(plan.gathers)
    return plan, shards, gathers


def _structural_plan(model: torch.nn.Module) -> DiffusionPlan | None:
    """The entry derived from a model built as one list of blocks followed by ``proj_out`` (Note [diffusion
    plans]), or None."""
    lists = [
        n for n, c in model.named_children() if isinstance(c, torch.nn.ModuleList) and n.endswith(("blocks", "layers"))
    ]
    # one list, or double-stream blocks followed by single-stream ones (which go on with the same two streams)
    paired = len(lists) == 2 and lists[1].startswith("single") and not lists[0].startswith("single")
    output = _output_module(model)
    if not (len(lists) == 1 or paired) or not len(getattr(model, lists[0])) or output is None:
        return None
    if "hidden_states" not in inspect.signature(getattr(model, lists[0])[0].forward).parameters:
        return None  # the tokens are not told apart by name (a sequence-first stream, ``x``)
    blocks, last = lists[0], lists[-1]
    # the last block's output where the forward computes per-token values over the whole tokens after the blocks
    gathered = f"{last}.{len(getattr(model, last)) - 1}" if type(model).__name__ in DIFFUSION_TAILS else output
    cut = {"hidden_states": Split(1, 3)}
    if _joint_blocks(getattr(model, blocks)):
        cut["encoder_hidden_states"] = Split(1, 3)
    elif paired:
        return None
    return DiffusionPlan(
        type(model).__name__,
        self_attention=lists[1] if paired else "",
        derived=True,
        shards={f"{blocks}.0": cut, **{f"{n}.*": {"*": TokenTables()} for n in lists}},
        gathers={gathered: (Gather(1, 3),)},
        notes=("derived from its structure",),
    )


_OUTPUTS = ("proj_out", "proj_out_2", "final_layer", "out_layer", "final_linear", "norm_out")
"""The names a DiT gives its output projection, the module whose output is gathered, in order of preference."""


def _output_module(model: torch.nn.Module) -> str | None:
    """The model's output projection (``_OUTPUTS``), or None."""
    return next((n for n in _OUTPUTS if isinstance(getattr(model, n, None), torch.nn.Module)), None)


def _joint_blocks(blocks: torch.nn.ModuleList) -> bool:
    """Whether the blocks carry a joint [text; tokens] stream: they take the text, and each of their attention
    modules says it is not cross-attention (``says_cross``)."""
    if "encoder_hidden_states" not in inspect.signature(blocks[0].forward).parameters:
        return False
    said = [says_cross(m) is False for _, m in attention_modules(blocks)]
    return bool(said) and all(said)


def _modules(model: torch.nn.Module, pattern: str, missing_ok: bool = False) -> list[tuple[str, torch.nn.Module]]:
    """The submodules a plan names: one exact name (``""`` is the model) or every match of a dotted pattern whose
    segments are fnmatch patterns of one name each ("blocks.*.attn1": the ``attn1`` of every block, not its parts;
    "blocks.-1": the last block).
    ``missing_ok``: a name matching nothing gives no modules (diffusers' plans list layers of the largest model)."""
    if ".-1" in pattern:  # the last of a list ("blocks.-1": its last block)
        head, _, rest = pattern.partition(".-1")
        try:
            listed = model.get_submodule(head)
        except AttributeError:
            listed = None  # no such list: the name matches nothing (below)
        pattern = f"{head}.{len(listed) - 1}{rest}" if isinstance(listed, torch.nn.ModuleList) else pattern
    if "*" not in pattern:
        try:
            return [(pattern, model.get_submodule(pattern))]
        except AttributeError:
            found = []
    else:
        parts = pattern.split(".")
        found = [
            (n, m)
            for n, m in model.named_modules()
            if n and len(n.split(".")) == len(parts) and all(map(fnmatch.fnmatchcase, n.split("."), parts))
        ]
    if not found and not missing_ok:
        raise SeqparInputError(f"{WHERE}: {type(model).__name__} has no module {pattern!r} that its plan names")
    return found


def _refusals(model: torch.nn.Module, plan: DiffusionPlan) -> list[str]:
    """What the model holds that seqpar cannot serve exactly: dropout (each rank would draw its own masks) and
    the module classes its plan refuses."""
    found = [
        f"{name or type(model).__name__} has dropout p={m.p}: each rank would draw the masks of its own tokens, "
        "not one process's draw over the sequence (set it to 0)"
        for name, m in model.named_modules()
        if isinstance(m, _DROPOUTS) and m.p > 0
    ]
    classes = {type(m).__name__: name or "the model" for name, m in model.named_modules()}
    refused = {**DIFFUSION_REFUSALS, **plan.refused}
    return found + [f"{classes[c]} is a {c}: {why}" for c, why in refused.items() if c in classes]


def _input_hook(entry: dict, sp: SequenceParallelMesh, layout: str, module_name: str, region: Region) -> Callable:
    """A forward pre-hook cutting the inputs ``entry`` names (by keyword or by their position)."""

    def hook(module, args, kwargs):
        region.open = True
        names = list(inspect.signature(module.forward).parameters)
        args = list(args)

        def get(key: str) -> object:
            if key in kwargs:
                return kwargs[key]
            return args[names.index(key)] if key in names and names.index(key) < len(args) else None

        for key, split in entry.items():
            if isinstance(split, TokenTables):
                cut_token_tables(names, args, kwargs, entry, sp, layout, module_name, region)
                continue
            if not isinstance(key, str) or (isinstance(split, Split) and split.output):
                continue
            where = f"{module_name or 'the model'}'s input {key}"
            if key in STREAMS and isinstance(split, Split) and isinstance(get(key), torch.Tensor):
                length = get(key).shape[split.dim]
                region.tokens, region.text = (length, None) if key == "hidden_states" else (region.tokens, length)
            # a JointSplit reads its parts' lengths as this module receives them (cut by the entries before)
            lengths = [getattr(get(p), "shape", (None, None))[1] for p in getattr(split, "parts", ())]
            lengths = [region.tokens] if isinstance(split, FoldedSplit) else lengths
            if key in kwargs:
                kwargs[key] = cut_any(kwargs[key], split, lengths, sp, layout, where)
            elif key in names and names.index(key) < len(args):
                args[names.index(key)] = cut_any(args[names.index(key)], split, lengths, sp, layout, where)
        return tuple(args), kwargs

    return hook


def _output_hook(entry: dict, sp: SequenceParallelMesh, layout: str, module_name: str) -> Callable:
    """A forward hook cutting the outputs at the indices ``entry`` names (the RoPE tables)."""

    def hook(module, args, output):
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        for key, split in entry.items():
            if isinstance(key, int) and isinstance(split, Split) and split.output:
                outputs[key] = cut(outputs[key], split, sp, layout, f"{module_name}'s output {key}")
        return outputs[0] if single else type(output)(outputs)

    return hook


def _gather_hook(
    gathers: tuple[Gather | None, ...], sp: SequenceParallelMesh, layout: str, region: Region, name: str, whole: bool
) -> Callable:
    """A forward hook gathering the outputs back to whole sequences (Note [replicated output]). ``whole``: a plan
    derived from the structure, whose gathered outputs must be shards of the tokens cut at the first block."""

    def hook(module, args, output):
        region.open, region.gathered = False, True
        if sp.sp_size == 1:
            return output
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        for i, gather in enumerate(gathers):
            if gather is not None and (gather.ndim is None or outputs[i].dim() == gather.ndim):
                rows = outputs[i].shape[gather.dim]
                if whole and region.tokens is not None and rows * sp.sp_size != region.tokens:
                    raise SeqparInputError(
                        f"{WHERE}: {name} gives {rows} tokens on this rank, not a shard of the {region.tokens} "
                        "tokens the plan derived from the model's structure cuts at its first block: the forward "
                        "adds or drops tokens between the blocks and the output (by a whole sequence's length), or "
                        "lays them out otherwise; register a plan for the model"
                    )
                dim = gather.dim % outputs[i].dim()
                outputs[i] = _ReplicatedGather.apply(outputs[i], sp, dim, layout, region.share)
        return outputs[0] if single else type(output)(outputs)

    return hook


def _call_check(model: torch.nn.Module, sp: SequenceParallelMesh, settings: str) -> Callable:
    """The model's first pre-hook: every argument (and the door's settings) equal on every rank."""
    parameters = list(inspect.signature(model.forward).parameters)

    def hook(module, args, kwargs):
        named = dict(zip(parameters, args)) | dict(kwargs)
        named = {n: named.get(n) for n in parameters} | {k: v for k, v in named.items() if k not in parameters}
        _agree(named | {"seqpar settings": settings}, sp.sp_group, "the model's arguments")

    return hook


def prepare_diffusers(
    model: torch.nn.Module, mesh: object, *, strategy: str = "auto", layout: str = "zigzag"
) -> torch.nn.Module:
    """Make a diffusers transformer run sequence-parallel (Note [diffusers door]).

    Call the model as usual, with the whole inputs (latents, timesteps, text embeddings) identical on every
    rank: it cuts the tokens itself and returns the whole prediction, the same on every rank. Compute the
    loss from it as in one process, backpropagate, then sum the gradients over the group with
    ``seqpar.reduce_gradients(model.parameters(), mesh)`` (Note [replicated output]). Idempotent: preparing
    again replaces the settings.

    Args:
        model: a diffusers transformer with an entry in ``seqpar.models.DIFFUSION_PLANS`` (Wan, LTX-Video,
            CogVideoX, HunyuanVideo, Flux, Qwen-Image, Latte, Z-Image and others), a ``_cp_plan``, or a plan
            derived from its structure.
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), the SP ProcessGroup, or None.
        strategy: as in ``seqpar.attention`` ("ulysses", "ring", "allgather", "hybrid", "auto").
        layout: "zigzag" or "contiguous": how the tokens (and timesteps, position tables, text) are cut.

    Returns:
        The same model object.

    Raises:
        SeqparInputError: a model class without a plan (naming it), dropout, a module class the plan refuses
            (HunyuanVideo's token-replace blocks), an unknown strategy or layout,
            parameters that differ across ranks (on every rank);
            at a call, on every rank: arguments that differ across ranks, a token or text length that does
            not divide into the layout, an attention mask in self-attention other than a key-padding mask
            (Note [key-padding masks]), dropout in self-attention, a non-native
            attention backend.
    """
    plan, shards, gathers = resolve_plan(model)
    problems = _refusals(model, plan)
    if problems:
        raise SeqparInputError(f"{WHERE}: seqpar cannot serve {type(model).__name__} exactly: " + " | ".join(problems))
    check_strategy_name(strategy)
    if layout not in LAYOUTS:
        raise SeqparInputError(f"{WHERE}: layout must be one of {LAYOUTS}, not {layout!r}")
    sp = as_sp_mesh(mesh)
    # one small all-gather: ranks with different weights would mix them in one forward (a DTensor is skipped)
    weights = {n: p for n, p in model.named_parameters() if not hasattr(p, "_local_tensor")}
    _agree(weights, sp.sp_group, "the model's parameters", _SAME_WEIGHTS)
    for handle in getattr(model, _HOOKS_ATTR, ()):
        handle.remove()
    handles = [model.register_forward_pre_hook(_call_check(model, sp, f"{strategy}/{layout}"), with_kwargs=True)]
    region = Region()
    if plan.derived:
        handles += region_hooks(model, region)
    tail_hooks(model, region, sp.sp_size, handles)
    for pattern, entry in shards.items():
        for name, module in _modules(model, pattern, missing_ok=plan.derived):
            hook = _input_hook(entry, sp, layout, name, region)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            if any(isinstance(s, Split) and s.output for s in entry.values()):
                handles.append(module.register_forward_hook(_output_hook(entry, sp, layout, name)))
    for pattern, outputs in gathers.items():
        whole = plan.derived and plan.shards is not None
        for name, module in _modules(model, pattern, missing_ok=plan.derived):
            handles.append(module.register_forward_hook(_gather_hook(outputs, sp, layout, region, name, whole)))
    if plan.derived:
        text_cut = any("encoder_hidden_states" in entry for entry in shards.values())
        joint = (f"{plan.self_attention}.",) if plan.self_attention else ()
        judge, names = judgement(region, text_cut, joint), [n for n, _ in attention_modules(model)]
    else:
        judge, names = None, [n for n, _ in _modules(model, plan.self_attention)]
    attention = [(n, attention_hooks(n, sp, strategy, layout, region, judge)) for n in names]
    for name, (enter, leave) in attention:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    setattr(model, _HOOKS_ATTR, handles)
    return model
