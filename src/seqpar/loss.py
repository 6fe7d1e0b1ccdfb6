"""Cross-entropy over a sequence (and data) parallel group, normalised by the global count of valid tokens.

The per-rank losses sum to the loss of the whole global batch, so gradients summed over ranks are exact.

Note [global token normalisation]
    Each rank returns ``sum of its token losses / N``, where N is the number of valid (not ignored) tokens
    in the whole global batch: every rank of the group, and every micro-batch of the optimizer step when
    accumulating gradients (pass ``num_valid_tokens`` from ``count_valid_tokens`` over the step's
    micro-batches). Summing these over ranks and micro-batches gives the mean token loss of the step, and
    summing the parameter gradients over ranks (``reduce_gradients``) gives its exact gradient, with no
    factor of the SP degree or the accumulation count. A rank with no valid token contributes 0.

Note [label smoothing per token]
    With ``label_smoothing=eps`` a token's loss is ``(1 - eps) x (-log p[label]) + eps x mean over the
    vocabulary of (-log p[v])`` (``F.cross_entropy``'s ``label_smoothing``), which is what transformers'
    ``LabelSmoother`` computes per token: it divides the summed NLL by ``num_items_in_batch`` and the
    summed ``-log p`` over the vocabulary by ``num_items_in_batch x V``. The Trainer passes the step's
    valid tokens over every process as ``num_items_in_batch`` (not a per-micro-batch mean), so the same
    global normaliser as the plain loss makes the smoothed loss, its gradient and its logged value exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from seqpar.data import IGNORE_INDEX
from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh
from seqpar.sequence_parallel.comm.collectives import collective_device


def sum_over(value: torch.Tensor, group: object) -> torch.Tensor:
    """Sum a (detached) tensor over ``group`` (collective), e.g. to log the loss of the whole batch.

    Args:
        value: any tensor; it is not modified.
        group: a ProcessGroup, a mesh (its SP group), or None (one process: the value is returned as is).

    Returns:
        The sum, on ``value``'s device (under NCCL a CPU tensor travels through the current GPU).
    """
    group = as_sp_mesh(group).sp_group  # a ProcessGroup stays itself; a mesh gives its SP group
    value = value.detach().clone()
    if group is None or dist.get_world_size(group) == 1:
        return value
    home = value.device
    if home.type == "cpu":  # NCCL reduces CUDA tensors only
        value = value.to(collective_device(group))
    dist.all_reduce(value, group=group)
    return value.to(home)


def count_valid_tokens(
    labels: torch.Tensor | Iterable[torch.Tensor], group: object = None, ignore_index: int = IGNORE_INDEX
) -> int:
    """Valid tokens in ``labels`` summed over ``group`` (collective): the normaliser of ``cross_entropy``.

    Args:
        labels: one ``shift_labels`` tensor, or those of every micro-batch of an optimizer step.
        group: a ProcessGroup (e.g. dp x sp), a mesh (its SP group), or None.
        ignore_index: label value that is not a token to predict.

    Returns:
        The global count, the same on every rank.
    """
    tensors = [labels] if isinstance(labels, torch.Tensor) else list(labels)
    local = sum(int((t != ignore_index).sum()) for t in tensors)
    return int(sum_over(torch.tensor(local, dtype=torch.int64), group))


def cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group: object = None,
    *,
    num_valid_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """This rank's share of the mean token cross-entropy of the global batch (Note [global token normalisation]).

    Args:
        logits: ``[B, S/P, V]`` this rank's logits (any float dtype; computed in float32).
        shift_labels: ``[B, S/P]`` from ``seqpar.shard_batch`` (already shifted; never shift them again).
        group: ranks whose tokens share the normaliser: a ProcessGroup (e.g. dp x sp), a mesh (its SP
            group), or None for one process. Ignored when ``num_valid_tokens`` is given.
        num_valid_tokens: the global count of valid tokens of the whole optimizer step; default: counted
            over ``group`` for this micro-batch (one small all-reduce).
        ignore_index: label value that is not a token to predict.
        label_smoothing: epsilon of Note [label smoothing per token]; 0: plain cross-entropy.

    Returns:
        A scalar; its sum over the group's ranks (and the step's micro-batches) is the mean token loss.

    Raises:
        SeqparInputError: shapes that do not match.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise SeqparInputError(f"logits {tuple(logits.shape)} and labels {tuple(shift_labels.shape)} do not match")
    if num_valid_tokens is None:
        num_valid_tokens = count_valid_tokens(shift_labels, group, ignore_index)
    total = F.cross_entropy(
        logits.flatten(0, -2).float(),
        shift_labels.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / max(num_valid_tokens, 1)


def _cast(weight: torch.Tensor, bias, cast: torch.dtype | None):
    """The head's weight and bias in ``cast`` (once per call, not per piece), or as they are."""
    if cast is None:
        return weight, bias
    return weight.to(cast), bias.to(cast) if bias is not None else None


def _piece_logits(hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``[chunk, V]`` float32 logits, the matmul in the dtype of ``weight`` (autocast's when it was on)."""
    return F.linear(hidden.to(weight.dtype), weight, bias).float()


class _HeadLossInPieces(torch.autograd.Function):
    """Summed token cross-entropy of ``hidden @ weight.T + bias``, a piece of ``chunk`` tokens at a time.

    The backward makes each piece's logits again and adds the piece's weight gradient into one ``[V, H]``
    buffer in place, so besides the inputs it holds one piece's logits and that buffer: autograd through
    per-piece checkpoints would keep a second ``[V, H]`` sum plus each piece's own weight gradient, and a
    full-size ``[T, H]`` gradient for every sliced piece of the hidden states. Under autocast the matmuls
    run in autocast's dtype, with the weight cast once per call; the weight gradient is summed in the
    weight's own dtype. Its backward is not differentiable again (no double backward).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, ignore_index: int, cast):
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk, ctx.ignore_index, ctx.cast = chunk, ignore_index, cast
        w, b = _cast(weight, bias, cast)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.numel(), chunk):
            piece = slice(start, start + chunk)
            logits = _piece_logits(hidden[piece], w, b)
            total += F.cross_entropy(logits, labels[piece], ignore_index=ignore_index, reduction="sum")
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if bias is not None and need_bias else None
        w, b = _cast(weight, bias, ctx.cast)
        for start in range(0, labels.numel(), ctx.chunk):
            piece = slice(start, start + ctx.chunk)
            # d(sum of -log softmax[label]) / d logits = softmax - one_hot(label); 0 for ignored tokens
            grad_logits = torch.softmax(_piece_logits(hidden[piece], w, b), dim=-1)
            keep = (labels[piece] != ctx.ignore_index)[:, None]
            target = labels[piece][:, None].masked_fill(~keep, 0)  # ignored rows are zeroed next
            grad_logits.scatter_add_(1, target, torch.full(target.shape, -1.0, device=target.device))
            grad_logits.masked_fill_(~keep, 0.0)
            grad_logits *= grad_total
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0).to(grad_bias.dtype)
            if grad_hidden is not None:
                grad_hidden[piece] = (grad_logits.to(w.dtype) @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.to(weight.dtype).T, hidden[piece].to(weight.dtype))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def lm_head_cross_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    shift_labels: torch.Tensor,
    group: object = None,
    *,
    chunk_size: int = 1024,
    num_valid_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``cross_entropy(lm_head(hidden), ...)`` without ever holding the whole ``[S/P, V]`` logits block.

    The tokens are cut into ``chunk_size`` pieces; each piece's logits are made, reduced to a loss and
    dropped, and made again in the backward, which adds each piece's output-head gradient into one buffer in
    place: the loss holds one piece's ``chunk_size x V`` float32 logits (twice in the backward) and one
    output-head-sized gradient, whatever the sequence length.

    Args:
        hidden: ``[B, S/P, hidden]`` final hidden states.
        lm_head: the output projection (``weight`` ``[V, hidden]``, optional ``bias``).
        shift_labels: as in ``cross_entropy``.
        group: as in ``cross_entropy``.
        num_valid_tokens: as in ``cross_entropy``.
        ignore_index: as in ``cross_entropy``.
        chunk_size: tokens per piece.

    Returns:
        The same scalar as ``cross_entropy`` (equal up to float summation order).

    Raises:
        SeqparInputError: hidden states and labels that do not match, a chunk_size below 1, or a DTensor head.
    """
    if chunk_size < 1:
        raise SeqparInputError(f"chunk_size must be a positive number of tokens, not {chunk_size!r}")
    if hidden.shape[:-1] != shift_labels.shape:
        raise SeqparInputError(f"hidden {tuple(hidden.shape)} and labels {tuple(shift_labels.shape)} do not match")
    from torch.distributed.tensor import DTensor  # here, not at the top: importing DTensor is most of seqpar's import

    if isinstance(lm_head.weight, DTensor):
        raise SeqparInputError(
            "lm_head_cross_entropy needs the output head's whole weight, not a DTensor (tensor parallel or FSDP2 "
            "around the head): use seqpar.cross_entropy on the model's logits"
        )
    if num_valid_tokens is None:
        num_valid_tokens = count_valid_tokens(shift_labels, group, ignore_index)
    flat_hidden = hidden.flatten(0, -2)
    flat_labels = shift_labels.flatten()
    device = hidden.device.type
    cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        total = _HeadLossInPieces.apply(
            flat_hidden, lm_head.weight, lm_head.bias, flat_labels, chunk_size, ignore_index, cast
        )
    return total / max(num_valid_tokens, 1)
