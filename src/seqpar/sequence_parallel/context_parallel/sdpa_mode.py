"""A TorchFunctionMode that serves ``F.scaled_dot_product_attention`` with ``seqpar.attention`` on local shards.

``seqpar.context_parallel`` enters it; ``agree_or_raise`` is the small cross-rank agreement on bad input both use.

Note [SDPA interception]
    A TorchFunctionMode sees every torch function called while it is on the thread's mode stack, whatever
    name the caller used (``F.scaled_dot_product_attention``, or the name imported before the block), and
    nothing is rebound, so leaving the block, normally or by an exception, leaves nothing behind. Torch
    takes the mode off the stack while it handles a call: seqpar's own torch calls are therefore not
    intercepted again, and nested blocks compose (the innermost serves SDPA, the outer ones pass seqpar's
    calls through). Calls that run more torch code which may reach SDPA (the backward entry points, whose
    engine recomputes checkpointed activations, and multi-head attention) go on one hop down with the mode
    put back, by ``torch.overrides.redispatch_function`` (torch >= 2.13); with an older torch such inner
    SDPA calls run as plain local attention, so activation checkpointing inside the block needs 2.13. The
    autograd engine carries the thread's state, this mode stack included, into its device threads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.overrides
from torch.overrides import TorchFunctionMode

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.api import attention
from seqpar.sequence_parallel.layouts.chunks import gather_sequence
from seqpar.sequence_parallel.masks import SequenceMask, key_mask

# The one builtin behind every spelling: F.scaled_dot_product_attention, torch.nn.functional's attribute,
# or the name imported from it before the block began all refer to this object.
_SDPA = F.scaled_dot_product_attention
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)  # torch >= 2.13
_REENTERED = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad, F.multi_head_attention_forward)

_SDPA_PROBLEMS = (
    "attn_mask is served only as a boolean key-padding mask over this rank's keys ([B, 1, 1, S/P], the same for "
    "every query and head, no is_causal; Note [key-padding masks]): a mask over query-key pairs of local shards "
    "cannot express a mask over the global sequence; pass is_causal=True for causal attention, or call "
    "seqpar.attention with position_ids= (packed documents) or window= (sliding window) for other masks",
    "dropout_p > 0 is not supported: attention dropout is not implemented; pass dropout_p=0.0",
    "query, key and value need at least 3 dimensions ([..., heads, seq, head_dim])",
    "key/value heads differ from query heads: pass enable_gqa=True for grouped-query attention",
    "query, key and value have different leading (batch) dimensions",
    "the query, key or value is not a shard of the sharded buffers (cross-attention to a text, or joint attention "
    "over [text; shard]): each rank would attend to its own copy of the other tokens, not once to the whole "
    "sequence; train diffusers transformers through seqpar.prepare_diffusers (Note [diffusion plans])",
)
_WHERE = "seqpar.context_parallel"


def agree_or_raise(
    group: dist.ProcessGroup | None,
    where: str,
    problem: tuple[int, str] | None,
    problems: Sequence[str],
    detail: Sequence[int] = (),
    describe: Callable[[list[int]], str] = str,
) -> None:
    """Raise the same ``SeqparInputError`` on every rank if any rank found a problem or ranks disagree.

    Each rank all-gathers ``[problem code, *detail]`` (a few integers; one small collective) so that a
    problem seen by one rank only stops every rank before the collectives that would otherwise hang.

    Args:
        group: the sequence-parallel group (None or size 1: no exchange).
        where: the name of the calling API, prefixed to the message.
        problem: this rank's ``(index into problems, detailed message)``, or None.
        problems: the short text of each problem code, used for the other ranks' problems.
        detail: integers every rank must agree on (e.g. number of buffers, sequence length); same length on
            every rank.
        describe: turns one rank's ``detail`` into words for the message.

    Raises:
        SeqparInputError: on every rank, naming which rank had which problem.
    """
    code = -1 if problem is None else problem[0]
    mine = torch.tensor([code, *detail], dtype=torch.int64)
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        rows, rank = [mine.tolist()], 0
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        mine = mine.to(device) if device is not None else mine
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        rows, rank = [g.tolist() for g in gathered], dist.get_rank(group)
    bad = [(r, row[0]) for r, row in enumerate(rows) if row[0] >= 0]
    if bad:
        texts = [f"rank {rank} (this rank): {problem[1]}"] if problem is not None else []
        texts += [f"rank {r}: {problems[c]}" for r, c in bad if r != rank]
        raise SeqparInputError(f"{where}: " + " | ".join(texts))
    if any(row[1:] != rows[0][1:] for row in rows):
        described = "; ".join(f"rank {r}: {describe(row[1:])}" for r, row in enumerate(rows))
        raise SeqparInputError(f"{where}: ranks disagree (every rank must pass the same): {described}")


def _key_padding(
    q: torch.Tensor, k: torch.Tensor, attn_mask: object, is_causal: bool
) -> tuple[torch.Tensor | None, tuple[int, str] | None]:
    """``([B, S/P] bool, None)`` from a key-padding ``attn_mask`` (Note [key-padding masks]), or a problem."""
    if attn_mask is None:
        return None, None
    m = attn_mask
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() < 2 or q.dim() < 3:
        told = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        return None, (0, f"{_SDPA_PROBLEMS[0]}; got {told}")
    heads = m.shape[-3] if m.dim() >= 3 else 1
    if is_causal or m.shape[-2] != 1 or heads != 1 or m.shape[-1] != k.shape[-2]:
        shape = f"{tuple(m.shape)} with is_causal={is_causal}, keys {k.shape[-2]}"
        return None, (0, f"{_SDPA_PROBLEMS[0]}; got a mask of shape {shape}")
    try:
        rows = torch.broadcast_to(m, (*q.shape[:-3], 1, 1, m.shape[-1])).reshape(-1, m.shape[-1])
    except RuntimeError:
        return None, (0, f"{_SDPA_PROBLEMS[0]}; its batch dims {tuple(m.shape[:-3])} do not fit {tuple(q.shape)}")
    return rows, None


def _sdpa_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool
) -> tuple[int, str] | None:
    if dropout_p:
        return 1, f"dropout_p={dropout_p}: {_SDPA_PROBLEMS[1]}"
    if min(q.dim(), k.dim(), v.dim()) < 3:
        return 2, f"{_SDPA_PROBLEMS[2]}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not enable_gqa and not q.shape[-3] == k.shape[-3] == v.shape[-3]:
        return 3, f"{_SDPA_PROBLEMS[3]} (heads {q.shape[-3]}, {k.shape[-3]}, {v.shape[-3]})"
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        return 4, f"{_SDPA_PROBLEMS[4]}: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    return None


_FRAMES_TO_PROCESSOR = 12  # frames between a diffusers attention processor and torch's SDPA (its dispatcher's)


def _diffusers_text_call() -> str | None:
    """The class of the diffusers attention module whose processor, on this thread's stack, was given
    ``encoder_hidden_states`` (cross- or joint attention; Note [foreign keys]), or None."""
    attention = sys.modules.get("diffusers.models.attention")
    processor = sys.modules.get("diffusers.models.attention_processor")
    if attention is None or processor is None:  # diffusers not in use: no processor can be on the stack
        return None
    classes = (attention.AttentionModuleMixin, processor.Attention)
    frame = sys._getframe(2)
    for _ in range(_FRAMES_TO_PROCESSOR):
        if frame is None:
            return None
        found = frame.f_locals
        if isinstance(found.get("attn"), classes) and "encoder_hidden_states" in found:
            text = found["encoder_hidden_states"]
            # older processors make self-attention's keys from encoder_hidden_states = hidden_states
            own = text is None or text is found.get("hidden_states")
            return None if own else type(found["attn"]).__name__
        frame = frame.f_back
    return None


def _length_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int | None) -> tuple[int, str] | None:
    """Keys, values or queries that are not this rank's shard of the sharded buffers (Note [foreign keys])."""
    if seq_len is None or q.dim() < 3:
        return None
    module = _diffusers_text_call()
    if module is not None:
        return 5, f"{_SDPA_PROBLEMS[5]} (the processor of a {module} was given encoder_hidden_states)"
    if q.shape[-2] == k.shape[-2] == v.shape[-2] and q.shape[-2] % seq_len == 0:
        return None
    lengths = f"query {q.shape[-2]}, key {k.shape[-2]}, value {v.shape[-2]} tokens; the shard holds {seq_len}"
    return 5, f"{_SDPA_PROBLEMS[5]} ({lengths})"


class SequenceParallelSDPA(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs ``seqpar.attention`` over ``mesh``.

    Every other torch function passes through unchanged. Inputs are this rank's shards in ``layout``
    order, ``[..., heads, local_seq, head_dim]``; ``is_causal``, ``scale`` and ``enable_gqa`` keep SDPA's
    meaning over the global sequence. A boolean ``attn_mask`` over this rank's keys alone is a key-padding
    mask and is served (Note [key-padding masks]); any other ``attn_mask`` and ``dropout_p > 0`` raise
    ``SeqparInputError`` on every rank (one small all-gather per call, then ``seqpar.attention``'s own
    agreement check), and so does a call whose tokens are not the shard's ``seq_len`` when it is given
    (Note [foreign keys]).

    Note [key-padding masks]
        A mask that hides some keys from every query (``[B, 1, 1, S/P]`` bool, True where a key is seen:
        the text padding of a joint [video; text] attention, HunyuanVideo and Qwen-Image) is a property of
        the keys, not of query-key pairs, so each rank's share of it is the mask of its own keys and means
        the same wherever those keys travel. The mode all-gathers the shares in the layout's global order
        (``B x S`` bytes per call) and runs ``seqpar.attention`` with it as a blockwise predicate (Note
        [blockwise masks], ``key_mask``): tiles over padding only are skipped, tiles of valid keys run
        unmasked, every strategy and layout serves it. Queries at padded positions still see every valid
        key, as in one process. A row whose keys are all hidden (NaN in SDPA) is refused; masks that vary
        over queries or heads, float (additive) masks and a mask with ``is_causal`` stay refused.

    Note [foreign keys]
        Every tensor the block shards covers one sequence, so an attention over those shards has as many
        queries as keys and values, a multiple of the buffers' local length ``seq_len`` (equal for token
        buffers; frames x patches for latents cut by frame). Keys of another length are not a shard:
        cross-attention to a text every rank holds whole (a shape error otherwise). Queries and keys over
        [text; shard] whose length is no such multiple are joint attention, where each rank would hold the
        whole text and its keys would count once per rank (silently wrong). A text whose length is such a
        multiple passes that test, so the mode also asks what a diffusers attention processor on the stack
        was given, as diffusers' own processors decide whether a call is context-parallel: one given
        ``encoder_hidden_states`` is cross- or joint attention, whatever the lengths. Both are refused on
        every rank, naming the diffusers door, which shards the text with the video or keeps cross-attention
        local. Attention outside diffusers' processors is judged by lengths alone.
    """

    def __init__(
        self, mesh: SequenceParallelMesh, strategy: str, layout: str, *, seq_len: int | None = None, where: str = _WHERE
    ) -> None:
        super().__init__()
        self.mesh, self.strategy, self.layout = mesh, strategy, layout
        self.seq_len = seq_len  # the sharded buffers' local length; None: not known (any length is served)
        self.where = where

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            # Note [SDPA interception]: only the calls that may reach SDPA inside go on with the mode back on
            if _REDISPATCH is None or func not in _REENTERED:
                return func(*args, **kwargs)
            with self:
                return _REDISPATCH(func, types_, args, kwargs)
        # Here the mode stays off: seqpar's own torch calls are not intercepted again (an enclosing block's
        # mode sees them and passes them through, since none of them is SDPA).
        return self.attention(*args, **kwargs)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention``'s signature, computed by ``seqpar.attention`` across the mesh.

        Raises:
            SeqparInputError: on every rank, if any rank passed a mask, dropout or shapes SDPA would refuse.
        """
        keys, problem = _key_padding(query, key, attn_mask, bool(is_causal))
        problem = (
            problem
            or _sdpa_problem(query, key, value, dropout_p, enable_gqa)
            or _length_problem(query, key, value, self.seq_len)
        )
        detail = [-1 if keys is None else keys.shape[0]]  # every rank passes a mask of the same rows, or none
        agree_or_raise(
            self.mesh.sp_group,
            f"{self.where}: scaled_dot_product_attention",
            problem,
            _SDPA_PROBLEMS,
            detail,
            lambda d: "no attn_mask" if d[0] < 0 else f"a key-padding mask of {d[0]} rows",
        )
        lead = query.shape[:-3]  # SDPA allows any number of batch dims; seqpar takes exactly one
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))  # [B, H, S/P, D]
        mask = None if keys is None else global_key_mask(keys, self.mesh, self.layout, self.where)
        out = attention(
            q,
            k,
            v,
            mesh=self.mesh,
            strategy=self.strategy,
            causal=bool(is_causal),
            layout=self.layout,
            scale=scale,
            mask=mask,
        )
        return out.reshape(*lead, *out.shape[1:])


def global_key_mask(keys: torch.Tensor, mesh: SequenceParallelMesh, layout: str, where: str) -> SequenceMask:
    """The ``SequenceMask`` of every rank's key-padding rows, gathered in global order (Note [key-padding masks]).

    Collective over the SP group (one all-gather of ``B x S/P`` bytes).

    Args:
        keys: ``[B, S/P]`` bool, this rank's keys (True: seen by every query).
        mesh: the sequence-parallel mesh.
        layout: the layout of the shards.
        where: the calling API, for the error.

    Returns:
        A ``SequenceMask`` whose predicate is the gathered key mask.

    Raises:
        SeqparInputError: a batch row with no valid key anywhere (SDPA would return NaN), on every rank.
    """
    whole = gather_sequence(keys.to(torch.uint8), mesh, dim=1, layout=layout).bool()  # [B, S]
    if not whole.any(-1).all():
        empty = (~whole.any(-1)).nonzero().flatten().tolist()
        raise SeqparInputError(f"{where}: the attn_mask hides every key of batch rows {empty}")
    return SequenceMask(predicate=key_mask(whole))
