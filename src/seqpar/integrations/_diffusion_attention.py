"""The attention side of ``seqpar.prepare_diffusers``: SDPA served per call, and derived entries' judgements.

Which attention modules attend over the shards (Note [derived attention]), and the hooks that serve them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from seqpar.errors import SeqparInputError
from seqpar.integrations._diffusion_gathered import check_compacted_text, gathered_call, segment_rows
from seqpar.mesh import SequenceParallelMesh
from seqpar.models.diffusion import DIFFUSION_REFUSED_ARGUMENTS
from seqpar.models.diffusion_attention import AttentionRow, attention_row
from seqpar.sequence_parallel.context_parallel.sdpa_mode import SequenceParallelSDPA

WHERE = "seqpar.prepare_diffusers"


class ServedSDPA(SequenceParallelSDPA):
    """The SDPA mode of one self-attention call; counts the calls it served (none: a non-native backend). Calls of
    the kinds Note [gathered keys] names are served by gathering the keys, the others by ``seqpar.attention``."""

    def __init__(self, *args, region: Region, row: AttentionRow | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.served, self.region, self.row = 0, region, row

    def attention(self, query: torch.Tensor, key: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        named = dict(zip(_SDPA_ARGUMENTS, args)) | kwargs
        named["attn_mask"] = _key_rows(named.get("attn_mask"))
        lengths = (self.region.tokens, self.region.text)
        self.served += 1
        out = gathered_call(query, key, named, self.mesh, self.layout, lengths, self.row, WHERE)
        return super().attention(query, key, **named) if out is None else out


_SDPA_ARGUMENTS = ("value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""SDPA's arguments after the query and the key, in order."""


def _key_rows(mask: object) -> object:
    """A key-padding mask broadcast over heads and queries by ``expand`` (stride 0: every head's and query's row the
    same by construction, LuminaNext's), as the ``[B, 1, 1, S]`` rows seqpar serves; any other mask as it is."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    if all(mask.shape[d] == 1 or mask.stride(d) == 0 for d in (1, 2)):
        return mask[:, :1, :1]
    return mask


@dataclass
class Region:
    """Where one forward is (Note [derived attention]): between a planned cut and the planned gather or not, and
    whether its gathers sum the gradient they receive over the group (Note [gathered tail])."""

    open: bool = False
    gathered: bool = False
    share: GatherShare = field(default_factory=lambda: GatherShare())  # this forward's (Note [gathered tail])
    tokens: int | None = None  # the whole token sequence's length, read at the cut of hidden_states
    text: int | None = None  # the whole text's length, read at its cut (a joint stream)
    judging: int = 0  # calls of judged attention modules in progress


class UnjudgedAttention(TorchFunctionMode):
    """Refuses SDPA inside the sharded region from anything but a judged attention module (Note [derived
    attention]): an attention class diffusers' mixins do not mark would attend to this rank's tokens alone."""

    def __init__(self, region: Region, model: str) -> None:
        super().__init__()
        self.region, self.model = region, model

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and self.region.open and not self.region.judging:
            raise SeqparInputError(
                f"{WHERE}: {self.model} calls scaled_dot_product_attention over its sharded tokens from a module "
                "that is no diffusers Attention or AttentionModuleMixin, so seqpar cannot tell what it attends to; "
                "register a plan for the model"
            )
        return func(*args, **(kwargs or {}))


_TEXT_OWN = ("add_", "added_", "txt_", "context_")
"""Name prefixes of an attention module's projections of the text's own (its queries too): joint attention."""
_QUERIES = ("to_q", "q_proj", "qkv")
"""Name parts of query projections: a module with two (``to_q`` and ``to_q_t``) projects the text's queries too."""


def says_cross(module: torch.nn.Module) -> bool | None:
    """Whether an attention module is cross-attention (Note [derived attention]): diffusers' ``is_cross_attention``
    where it has one; else joint where it projects the text with projections of its own (``add_k_proj``,
    ``txt_attn_qkv``, a second query projection ``to_q_t``), cross where its keys are projected from another width
    than its queries; None: it does not say."""
    row = attention_row(module)
    if row is not None and row.text_keys:  # the text as keys only: kept whole, as cross-attention's
        return True
    cross = getattr(module, "is_cross_attention", None) if row is None or row.cross is None else row.cross
    if cross is not None:
        return bool(cross)
    projections = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    queries = [n for n in projections if any(q in n for q in _QUERIES)]
    if len(queries) > 1 or any(n.startswith(_TEXT_OWN) for n in projections):
        return False
    to_q, to_k = getattr(module, "to_q", None), getattr(module, "to_k", None)
    widths = [getattr(m, "in_features", None) for m in (to_q, to_k)]
    return True if None not in widths and widths[0] != widths[1] else None


def _argument(module: torch.nn.Module, args: tuple, kwargs: dict, key: str) -> object:
    """The module call's argument ``key``, by keyword or by its position in the module's forward."""
    if key in kwargs:
        return kwargs[key]
    names = list(inspect.signature(module.forward).parameters)
    return args[names.index(key)] if key in names and names.index(key) < len(args) else None


def _judgement(
    name: str, module: torch.nn.Module, args: tuple, kwargs: dict, region: Region, text_cut: bool, joint: tuple
) -> bool:
    """Whether an attention module of a derived entry attends over the shards (Note [derived attention])."""
    row = attention_row(module)
    said = "encoder_hidden_states" if row is None else row.text
    text, tokens = (_argument(module, args, kwargs, k) for k in (said, "hidden_states"))
    if not region.open or text is None or text is tokens:  # self-attention given its tokens as the text too
        return region.open
    if row is not None and row.text_keys:  # the text joined to the keys of the tokens' queries (Note [gathered keys])
        if text_cut:
            raise SeqparInputError(
                f"{WHERE}: {name} joins the text to the keys of the tokens' queries, but the plan derived for the "
                "model cuts the text across the ranks; register a plan that keeps the text whole"
            )
        return True
    cross = says_cross(module)
    cross = False if cross is None and name.startswith(joint) else cross
    if cross is None:
        raise SeqparInputError(
            f"{WHERE}: {name} ({type(module).__name__}) is given encoder_hidden_states but does not say whether it "
            "is cross-attention or joint attention (no is_cross_attention, no projections of the text's own, keys "
            "projected from the tokens' width); register a plan for the model"
        )
    if not cross:  # joint attention over [text; tokens]
        if not text_cut:
            raise SeqparInputError(
                f"{WHERE}: {name} attends jointly over the text and the tokens, but the plan derived for the model "
                "keeps the text whole on every rank: its keys would count once per rank (register a plan that cuts "
                "the text with the tokens)"
            )
        return True
    if text_cut:
        raise SeqparInputError(
            f"{WHERE}: {name} is cross-attention to a text that the plan derived for the model cuts across the "
            "ranks: seqpar attends this rank's queries to whole keys only (register a plan that keeps the text whole)"
        )
    return False


def judgement(region: Region, text_cut: bool, joint: tuple = ()) -> Callable[[str, torch.nn.Module, tuple, dict], bool]:
    """A derived entry's judgement of an attention module's call (Note [derived attention]); ``joint``: name
    prefixes of the blocks whose attention modules are joint where they do not say (single-stream blocks)."""
    return lambda name, module, args, kwargs: _judgement(name, module, args, kwargs, region, text_cut, joint)


def attention_hooks(
    name: str,
    sp: SequenceParallelMesh,
    strategy: str,
    layout: str,
    region: Region,
    judge: Callable[[str, torch.nn.Module, tuple, dict], bool] | None = None,
) -> tuple[Callable, Callable]:
    """A pre-hook entering an SDPA mode for one attention call, and an always-called hook leaving it. ``judge``
    (a derived entry's) decides at the module's first call whether it is served at all; None: it is."""
    judged: list[bool] = [] if judge is not None else [True]
    active: list[ServedSDPA | None] = []  # this module's open calls (one, or one per recomputation)

    def enter(module, args, kwargs):
        if not judged:
            judged.append(judge(name, module, args, kwargs))
        refused = [k for k in DIFFUSION_REFUSED_ARGUMENTS if judged[0] and kwargs.get(k) is not None]
        if refused:  # the same arguments on every rank: every rank raises here
            raise SeqparInputError(f"{WHERE}: {name} is given {refused[0]}: {DIFFUSION_REFUSED_ARGUMENTS[refused[0]]}")
        row = attention_row(module)
        mode = ServedSDPA(sp, strategy, layout, where=WHERE, region=region, row=row) if judged[0] else None
        if mode is not None:
            mode.__enter__()
        active.append(mode)
        region.judging += 1
        if mode is not None and row is not None and row.compacts_text and sp.sp_size > 1:
            check_compacted_text(_argument(module, args, kwargs, "attention_mask"), sp, f"{WHERE}: {name}")
        if mode is not None and row is not None and row.segments and sp.sp_size > 1:
            tokens = _argument(module, args, kwargs, "hidden_states")
            return args, segment_rows(kwargs, tokens.shape[1], sp, layout, WHERE)
        return None

    def leave(module, args, kwargs, output):
        if not active:  # the pre-hook raised
            return
        region.judging -= 1
        mode = active.pop()
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if output is not None and mode.served == 0:
            raise SeqparInputError(
                f"{WHERE}: the attention {name} did not call torch's scaled_dot_product_attention: it computes "
                "another attention over this rank's tokens alone (a linear attention), or runs a non-native backend "
                "(model.set_attention_backend('native'), no DIFFUSERS_ATTN_BACKEND)"
            )

    return enter, leave


def region_hooks(model: torch.nn.Module, region: Region) -> list:
    """Hooks that start each forward of a derived entry's model with a closed region and ``UnjudgedAttention``
    on, and take it off at the end (also when the forward raises)."""
    guards: list[UnjudgedAttention] = []

    def start(module, args, kwargs):
        region.open = region.gathered = False
        region.judging = 0
        guards.append(UnjudgedAttention(region, type(model).__name__))
        guards[-1].__enter__()

    def end(module, args, kwargs, output):
        if guards:
            guards.pop().__exit__(None, None, None)

    return [
        model.register_forward_pre_hook(start, with_kwargs=True),
        model.register_forward_hook(end, with_kwargs=True, always_call=True),
    ]


class GatherShare:
    """Whether one forward's gathers sum the gradient they receive over the group before handing back this rank's
    tokens' share (Note [gathered tail]): where that forward's output gradient is scaled by 1 / P."""

    def __init__(self) -> None:
        self.summed = False


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by ``factor`` (Note [gathered tail])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _scaled(value: object, factor: float) -> object:
    """``value`` (a tensor, or tensors nested in tuples, lists, dicts or diffusers' output classes) with the gradient
    of each floating tensor that requires one scaled by ``factor``."""
    if isinstance(value, torch.Tensor):
        return _ScaledGradient.apply(value, factor) if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        return type(value)(_scaled(v, factor) for v in value)
    if isinstance(value, dict):  # diffusers' BaseOutput keeps its fields as items and attributes alike
        for key in list(value):
            value[key] = _scaled(value[key], factor)
    return value


def tail_hooks(model: torch.nn.Module, region: Region, sp_size: int, handles: list) -> list:
    """A hook that, at the end of a forward that gathered the tokens, scales the gradient of its output by 1 / P and
    has its gathers sum theirs over the group (Note [gathered tail])."""

    def start(module, args, kwargs):
        region.gathered = False
        region.share = GatherShare()  # a new one a forward: the backward of an earlier forward keeps its own

    def end(module, args, kwargs, output):
        if sp_size == 1 or not torch.is_grad_enabled() or not region.gathered:
            return output
        region.share.summed = True
        return _scaled(output, 1.0 / sp_size)

    handles.append(model.register_forward_pre_hook(start, with_kwargs=True))
    handles.append(model.register_forward_hook(end, with_kwargs=True))
    return handles


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every attention module of a diffusers model: its ``Attention`` and ``AttentionModuleMixin`` instances, and
    the modules of another class with a row (``attention_row``)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    classes = (Attention, AttentionModuleMixin)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, classes) or attention_row(m) is not None]
