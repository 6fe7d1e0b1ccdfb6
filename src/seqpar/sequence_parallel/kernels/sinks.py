"""Attention sinks (gpt-oss): one learned logit per head in every query's softmax denominator (Note [attention sinks]).

Applied once to the final merged (out, lse) of a row; its gradient comes from the same final statistics.

Note [attention sinks]
    Head h has a learned logit z_h that joins every row's softmax with value 0: p_j = exp(s_j - L') for the
    keys and p_z = exp(z_h - L') for the sink, L' = logsumexp(s_1..s_n, z_h). In the merge of Note [LSE merge]
    it is one more block, with out 0 and lse z_h, merged after all key blocks: L' = logaddexp(L, z_h) and
    O' = exp(L - L') O, where (O, L) is the result over the keys alone. It must come last and once per row,
    so strategies add it after their merge, on the rank that holds the row's queries (of that head).

    Backward: O' = sum_j p_j v_j + p_z * 0, so dO'/ds_j = p_j (v_j - O') and dO'/dz_h = -p_z O' (the
    softmax Jacobian with the sink's value 0). The first is the ordinary attention backward evaluated with
    the final (O', L'): kernels take the final out and lse already, and with (O', L') their exp(s - L') is
    the sink-aware probability and their rowsum(dO * O') the correction term, so dq, dk, dv need no change.
    The second gives, per head, dz_h = -sum over the batch and this rank's query rows of
    exp(z_h - L') * rowsum(dO * O'). The sink is a parameter replicated over the SP ranks; each rank's dz
    covers its own rows (or, under Ulysses, all rows of its own heads and 0 elsewhere), and summing the
    ranks' gradients (Note [summed gradients]) gives the one-process gradient.
"""

from __future__ import annotations

import torch


def _finite_ref(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0, so that exp(x - ref) is 0 rather than NaN when x is -inf too."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The final ``(out, lse)`` of rows whose softmax also counts each head's sink logit.

    Args:
        out: ``[B, H, S, D]``, the merged output over all keys (any float dtype).
        lse: ``[B, H, S]`` float32 log-sum-exp over all keys (-inf for a row that saw none).
        sinks: ``[H]``, one logit per query head of ``out``.

    Returns:
        ``(out, lse)`` in float32 with the sink merged in (a row that saw no key keeps out 0).
    """
    z = sinks.detach().float().view(1, -1, 1)  # [1, H, 1]
    new = torch.logaddexp(lse, z)  # [B, H, S]
    return out.float() * torch.exp(lse - _finite_ref(new)).unsqueeze(-1), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits from this rank's rows: ``-sum exp(z_h - lse) * rowsum(dout * out)``.

    Args:
        dout: ``[B, H, S, D]`` gradient of the output.
        out: ``[B, H, S, D]`` final output (sink included, ``add_sinks``).
        lse: ``[B, H, S]`` final log-sum-exp (sink included).
        sinks: ``[H]`` the sink logits.

    Returns:
        ``[H]`` in ``sinks``' dtype.
    """
    z = sinks.detach().float().view(1, -1, 1)  # [1, H, 1]
    delta = (dout.float() * out.float()).sum(-1)  # [B, H, S]
    p_sink = torch.exp(z - _finite_ref(lse))  # [B, H, S]
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


def head_slice(sinks: torch.Tensor | None, part: int, parts: int) -> torch.Tensor | None:
    """Part ``part`` of ``parts`` equal, contiguous slices of the heads' sinks (autograd keeps the rest at 0).

    Args:
        sinks: ``[H]`` or None.
        part: which slice.
        parts: how many slices (divides H).

    Returns:
        ``[H / parts]``, or None for None.
    """
    return None if sinks is None else sinks.view(parts, -1)[part]
