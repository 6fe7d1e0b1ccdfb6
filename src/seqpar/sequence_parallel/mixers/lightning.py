"""MiniMax's lightning attention under sequence parallelism: its blocked linear attention run from a given state.

The adapter's ``forward`` (Note [mixer adapters]); the state passes between ranks as in Note [state passing].

Note [lightning blocks]
    Lightning attention keeps a state ``S`` (``[heads, d, d]``) with one decay per head, ``lambda = exp(-s)``:
    ``S_t = lambda S_{t-1} + k_t v_t^T`` and ``o_t = q_t S_t`` (no softmax, no scaling). transformers runs it
    inline in the layer's forward, in blocks of ``block_size`` tokens from the start of the call: within a
    block ``(q k^T * D) v`` with ``D_ij = lambda^(i - j)`` for ``j <= i``, plus ``lambda^(i + 1) q_i S`` from
    the state before the block, which then moves on as ``lambda^n S + sum_j lambda^(n - 1 - j) k_j v_j^T``.
    Every factor depends on offsets inside the block or from its start, never on a token's place in the
    sequence, so the blocks may start anywhere: run from any token with the state before it, they give the
    same recurrence. seqpar's pieces (a rank's chunk, or its part after a document start) therefore start
    their own blocks at the piece's first token, with the layer's own decay tables, and a piece of ``n`` tokens
    maps the state that enters it to ``lambda^n S_in + S_loc``: ``M = lambda^n I``, of which ``lambda^n``
    alone travels (``decay_only``, Note [state passing]), and the state adds ``lambda^(t + 1) q_t S_in`` to the
    piece's token ``t``. Only the rounding differs
    from one process, whose blocks follow the whole row's grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import adapter_context
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan


def _lightning(
    self: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's blocked recurrence on one piece (Note [lightning blocks]): ``q``, ``k``, ``v`` ``[B, T, H, d]``,
    ``state`` ``[B, H, d, d]`` before the piece (None: zeros, in the values' dtype as transformers starts them).
    Returns the output ``[B, T, H, d]`` and the state after the piece."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d], as the layer computes
    batch, heads, _, dim = v.shape
    if state is None:
        state = v.new_zeros(batch, heads, dim, dim)
    outputs = []
    # split, not sliced: a slice's backward writes a tensor of the whole input, once per block
    for q_b, k_b, v_b in zip(*(t.split(self.block_size, dim=2) for t in (q, k, v)), strict=True):
        n = q_b.shape[2]
        intra = torch.matmul(torch.matmul(q_b, k_b.transpose(-1, -2)) * self.diagonal_decay[:, :, :n, :n], v_b)
        inter = torch.matmul(q_b * self.query_decay[:, :n], state)
        outputs.append(inter + intra)
        carried = torch.matmul((k_b * self.key_decay[:, -n:]).transpose(-1, -2), v_b)
        state = state * torch.exp(-self.slope_rate * n) + carried
    return torch.cat(outputs, dim=-2).transpose(1, 2), state


def minimax_lightning_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: object | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``MiniMaxLightningAttention.forward`` on this rank's shard, the recurrent state passed between ranks.

    The projections, activation, output norm, sigmoid gate and output projection are the layer's own, per token;
    the recurrence runs in blocks from each piece's first token (Note [lightning blocks]), and the state decays by
    ``exp(-slope n)`` over a piece of ``n`` tokens, so ``M`` is that number per head times the identity (Note
    [state passing]).

    Args:
        self: the ``MiniMaxLightningAttention`` (``qkv_proj``, ``act_fn``, ``norm``, ``output_gate``, ``out_proj``
            and the decay tables ``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        position_embeddings: unused (lightning attention has no rotary embedding).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        cache: must be None (seqpar trains without a cache).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]`` and None where the layer returns its final state (the decoder layer discards it; a rank's
        last state is not the sequence's).

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = adapter_context(self, cache, kwargs, silu=False)
    batch, length, _ = hidden_states.shape
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(batch, length, self.num_attention_heads, 3 * self.head_dim)
    query, key, value = torch.split(qkv, self.head_dim, dim=3)

    def run(q, k, v, initial_state):
        return _lightning(self, q, k, v, initial_state)

    def opening(q, k, v):  # the state decays by exp(-slope) a token (Note [lightning blocks]): M = exp(-slope n) I
        out, local = _lightning(self, q, k, v, None)
        steps = torch.arange(1, q.shape[1] + 1, device=q.device)
        grown = torch.exp(-self.slope_rate.float() * steps[:, None])  # [H, T, 1]: left of the state that entered
        reads = q.transpose(1, 2).float() * grown  # [n, H, T, d], as the layer reads its state

        def respond(entering):  # [n, H, d, d] -> [n, T, H, d]
            return torch.matmul(reads, entering.float()).transpose(1, 2)

        return Opening(out, local, grown[None, :, -1:].expand(q.shape[0], -1, -1, -1), respond)

    state = (self.num_attention_heads, self.head_dim, self.head_dim)
    inputs = (query, key, value)
    out = chunked_state_scan(run, opening, inputs, state, ctx.mesh, ctx.layout, ctx.mask, decay_only=True)
    out = self.norm(out.reshape(batch, length, self.num_attention_heads * self.head_dim))
    return self.out_proj(F.sigmoid(self.output_gate(hidden_states)) * out), None
