"""Mamba1 layers (Mamba, Falcon-Mamba, Jamba, Zamba) under sequence parallelism: halo convolution, then the scan.

The adapters' ``forward`` (Note [mixer adapters]): seqpar's scan of a piece from a given state (Note [Mamba1 state]).

Note [Mamba1 state]
    Mamba1's selective scan keeps a state per channel ``d`` and state entry ``n``,
    ``h <- exp(dt_d A_dn) h + dt_d B_n x_d``, read as ``y_d = C . h_d + D_d x_d``. Its decay is one number per
    (channel, entry), so over a piece of tokens ``S_out = M * S_in + S_loc`` elementwise, with
    ``M = exp(A sum(dt))`` over the piece (the product of its steps' decays). seqpar passes it through
    ``chunked_state_scan`` as ``d_inner * d_state`` heads of a 1 x 1 state (Note [state passing]): ``M`` is that
    number, the exchange moves two numbers per channel, entry and chunk, and the state that enters a piece adds
    ``C_t . (exp(A sum_{s <= t} dt_s) * S_in)`` to token ``t``'s read. transformers' scan
    (``mamba_selective_scan``) starts from zeros only, so a piece's scan is seqpar's: transformers' sequential
    recurrence in its dtypes (decay and drive in float32, the read in the input's dtype), from the given state.
    Cost: a step per token, as transformers' torch path takes (the fused CUDA scan takes no initial state and
    returns no differentiable final one). The piece is ``split`` into blocks and a block ``unbind`` into steps:
    indexing ``x[:, t]`` (or slicing a block) would give each step's (block's) backward a zero tensor of the
    whole input, quadratic in the length. Nothing of shape ``[L, D, N]`` is kept: a block of
    ``Mamba1.scan_block`` tokens forms its decays and drives from ``dt``, ``B`` and ``x`` under no_grad and keeps
    only its inputs and entering state (``_BlockScan``); its backward forms the block's states again and runs the
    adjoint recurrence backwards, ``dS_{t-1} = decay_t dS_t + C_t dread_t`` (from the final state's gradient),
    whence ``d decay_t = dS_t S_{t-1}`` and ``d drive_t = dS_t``, summed into dt, B, x and A by matrix products.
    So the backward holds one block's states at a time, and no per-token autograd graph is built (a checkpointed
    block recorded one in its forward and again in its backward, which made the scan twice as slow).
    The entering state's read (``_Carried``) goes a block at a time the same way, its gradients summed by hand
    from the block's decays formed again. Its exponent ``A e_t`` (``e_t`` the steps elapsed since the piece's
    start) is held at ``_FLOOR = -60``: a factor under ``exp(-60) ~ 1e-26`` of the state is read as that, its
    gradient through the exponent taken at the floor. Both lie nineteen orders under float32's rounding of the
    state's read (the exact value keeps shrinking, and one process's fp32 scan loses it to underflow likewise), and
    the hold keeps the CPU's ``exp`` and the products after it out of float32's subnormal range, where they run
    an order of magnitude slower (the read cost more than the piece's scan before).
    Zamba's mixer is Mamba1 in ``n_mamba_heads`` heads, each with its own x and dt projections, so its own B and
    C (``[B, L, H, N]``); x and the gate come out of ``in_proj`` interleaved channel by channel. The same scan
    runs with every channel axis split ``H, D/H`` (``rate`` ``[H, D/H, N]``): all heads in one pass and one
    exchange, the state one number per (head, channel, entry) as above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar.models.mixers import Mamba1
from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext, adapter_context
from seqpar.sequence_parallel.mixers.conv import layer_conv
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan


def _steps(
    dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, u: torch.Tensor, rate: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recurrence over a block of tokens from ``state`` ``[n, D, N]``: (reads ``[n, T, D]``, state).
    With heads (Zamba's), every ``D`` is ``H, D/H`` and ``b``, ``c`` are ``[n, T, H, N]``."""
    decays = torch.exp(rate * dt[..., None])  # [n, T, D, N], one block's, as transformers' discrete A
    drives = dt[..., None] * b[..., None, :].float() * u[..., None].float()
    states = []
    for decay, drive in zip(decays.unbind(1), drives.unbind(1), strict=True):
        state = torch.addcmul(drive, decay, state)
        states.append(state)
    reads = torch.matmul(torch.stack(states, dim=1).to(u.dtype), c[..., None])[..., 0]
    return reads, state


class _BlockScan(torch.autograd.Function):
    """``_steps`` with its own backward: the forward keeps only the block's inputs and entering state, the backward
    forms the block's states again and runs the adjoint recurrence (Note [Mamba1 state])."""

    @staticmethod
    def forward(ctx, dt, b, c, u, rate, state):
        with torch.no_grad():
            reads, final = _steps(dt, b, c, u, rate, state)
        ctx.save_for_backward(dt, b, c, u, rate, state)
        return reads, final

    @staticmethod
    def backward(ctx, grad_reads, grad_final):
        dt, b, c, u, rate, entering = ctx.saved_tensors
        with torch.no_grad():
            decays = torch.exp(rate * dt[..., None])
            drive_b, drive_u = b[..., None, :].float(), u[..., None].float()
            drives = dt[..., None] * drive_b * drive_u
            states, state = [], entering
            for decay, drive in zip(decays.unbind(1), drives.unbind(1), strict=True):
                state = torch.addcmul(drive, decay, state)
                states.append(state)
            states = torch.stack(states, dim=1)
            wide = torch.promote_types(grad_reads.dtype, torch.float32)  # float32 at least, as the states
            read_in = grad_reads[..., None].to(wide) * c[..., None, :].to(wide)  # each read's share of dS_t
            carry = torch.zeros_like(entering) if grad_final is None else grad_final
            adjoint = []
            for t in range(dt.shape[1] - 1, -1, -1):  # dS_t = C_t dread_t + decay_{t+1} dS_{t+1}
                total = read_in[:, t] + carry
                adjoint.append(total)
                carry = decays[:, t] * total
            adjoint = torch.stack(adjoint[::-1], dim=1)
            before = torch.cat([entering[:, None], states[:, :-1]], dim=1)
            driven = torch.matmul(adjoint, b[..., :, None].float().to(adjoint.dtype))[..., 0]  # sum over N: dS_t B_t
            grad_b = torch.matmul((dt * drive_u[..., 0])[..., None, :], adjoint)[..., 0, :]  # sum over D
            grad_c = torch.matmul(grad_reads[..., None, :].to(wide), states.to(u.dtype).to(wide))[..., 0, :]
            grad_decay = adjoint.mul_(before).mul_(decays)  # adjoint no longer needed as itself
            grad_dt = (grad_decay * rate).sum(-1) + driven * drive_u[..., 0]
            grad_rate = (grad_decay * dt[..., None]).sum(dim=(0, 1))
            grad_u = driven * dt
        return (
            grad_dt.to(dt.dtype),
            grad_b.to(b.dtype),
            grad_c.to(c.dtype),
            grad_u.to(u.dtype),
            grad_rate.to(rate.dtype),
            carry.to(entering.dtype),
        )


def _scan_piece(
    dt: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    u: torch.Tensor,
    rate: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of n pieces (stacked as rows) from ``initial_state`` (Note [Mamba1 state]).

    Args:
        dt: ``[n, T, D]`` the time steps (softplus applied).
        b: ``[n, T, N]`` the drive's input projection.
        c: ``[n, T, N]`` the read-out.
        u: ``[n, T, D]`` the scan's input; its dtype is the one the state is read in.
        rate: ``[D, N]`` ``A = -exp(A_log)``, float32 (``[H, D/H, N]`` with heads, as ``_steps`` takes them).
        initial_state: ``[n, D * N, 1, 1]`` the state entering each piece, or None for zeros.

    Returns:
        ``C . h`` per token ``[n, T, D]``, and the final states ``[n, D * N, 1, 1]``.
    """
    rows = dt.shape[0]
    if initial_state is None:  # zeros (transformers starts from zeros)
        state = dt.new_zeros(rows, *rate.shape, dtype=torch.float32)
    else:
        state = initial_state.reshape(rows, *rate.shape)
    reads = []
    blocks = zip(*(t.split(Mamba1.scan_block, dim=1) for t in (dt, b, c, u)), strict=True)
    for block in blocks:  # each block starts from the state the one before left
        read, state = _BlockScan.apply(*block, rate, state) if torch.is_grad_enabled() else _steps(*block, rate, state)
        reads.append(read)
    return torch.cat(reads, dim=1), state.reshape(rows, rate.numel(), 1, 1)


_FLOOR = -60.0
"""The lowest exponent ``A e_t`` a decayed entering state is read at (Note [Mamba1 state])."""


def _decays(rate: torch.Tensor, elapsed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``exp(A e_t)`` for a block ``[n, T, D, N]`` into ``out``, held at ``exp(_FLOOR)`` (Note [Mamba1 state])."""
    return torch.mul(rate, elapsed[..., None], out=out).clamp_(min=_FLOOR).exp_()


class _Carried(torch.autograd.Function):
    """The read of the states ``entering`` (``[n, D, N]``) decayed to each token, ``C_t . (exp(A e_t) * S_in)``
    (``[n, T, D]``), a block of ``Mamba1.scan_block`` tokens at a time; its backward forms each block's decays again
    and sums their gradients by hand, so nothing of shape ``[T, D, N]`` outlives a block (Note [Mamba1 state])."""

    @staticmethod
    def forward(ctx, elapsed, c, rate, entering):
        reads, buffers = [], {}
        for e, c_block in zip(elapsed.split(Mamba1.scan_block, dim=1), c.split(Mamba1.scan_block, dim=1), strict=True):
            shape = (*e.shape, rate.shape[-1])
            if shape not in buffers:  # one per block length: every block but the last reuses it
                buffers[shape] = e.new_empty(shape)
            kept = _decays(rate, e, buffers[shape]).mul_(entering[:, None])
            reads.append(torch.matmul(kept.to(c.dtype), c_block[..., None])[..., 0])
        ctx.save_for_backward(elapsed, c, rate, entering)
        return torch.cat(reads, dim=1)

    @staticmethod
    def backward(ctx, grad):
        elapsed, c, rate, entering = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)
        grad_e, grad_c, buffers = [], [], {}
        grad_rate, grad_entering = torch.zeros_like(rate, dtype=wide), torch.zeros_like(entering, dtype=wide)
        pieces = (t.split(Mamba1.scan_block, dim=1) for t in (elapsed, c, grad))
        for e, c_block, g in zip(*pieces, strict=True):
            g, c_block, shape = g.to(wide), c_block.to(wide), (*e.shape, rate.shape[-1])
            if shape not in buffers:
                buffers[shape] = (e.new_empty(shape, dtype=wide), e.new_empty(shape, dtype=wide))
            share, scratch = buffers[shape]
            _decays(rate, e, share)
            grad_c.append(torch.matmul(g[..., None, :], torch.mul(share, entering[:, None], out=scratch))[..., 0, :])
            # each (t, d, n) term's gradient, g_td C_tn exp(A_dn e_td), then times S_in for the exponent's
            share.mul_(g[..., None]).mul_(c_block[..., None, :])
            grad_entering += share.sum(dim=1)
            share.mul_(entering[:, None])
            grad_e.append(torch.mul(share, rate, out=scratch).sum(-1))
            grad_rate += torch.mul(share, e[..., None], out=scratch).sum(dim=(0, 1))
        return (
            torch.cat(grad_e, dim=1).to(elapsed.dtype),
            torch.cat(grad_c, dim=1).to(c.dtype),
            grad_rate.to(rate.dtype),
            grad_entering.to(entering.dtype),
        )


def mamba1_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: object | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``MambaMixer.forward`` (and ``FalconMambaMixer``'s and ``JambaMambaMixer``'s, with their norms on dt, B and C)
    on this rank's shard, the convolution and the scan's state exchanged (Note [Mamba1 state]).

    Args:
        self: the layer (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: seqpar's call context, which these layers are handed in place of a mask (Note [context
            in the mask]); any other value is ignored, as seqpar's calls carry no mask.
        **kwargs: the layer's keywords.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    if isinstance(attention_mask, CallContext):
        kwargs = {**kwargs, CONTEXT_KEY: attention_mask}
    ctx = adapter_context(self, cache, kwargs, silu=False)  # the layer's own activation is applied below
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
    conv = layer_conv(self, x.transpose(1, 2), self.conv1d, ctx, bias=self.use_conv_bias)
    u = self.act(conv).transpose(1, 2)  # [B, L, D]
    entries = self.ssm_state_size
    step, b, c = torch.split(self.x_proj(u), [self.time_step_rank, entries, entries], dim=-1)
    if getattr(self, "dt_layernorm", None) is not None:  # Falcon-Mamba's and Jamba's norms on dt, B and C
        step, b, c = self.dt_layernorm(step), self.b_layernorm(b), self.c_layernorm(c)
    dt = (self.dt_proj.weight @ step.transpose(1, 2)).transpose(1, 2)  # [B, L, D], the bias added below
    dt = F.softplus(dt + self.dt_proj.bias.float().to(dt.dtype))
    rate = -torch.exp(self.A_log.float())  # [D, N]
    y = selective_scan(dt, b, c, u, rate, ctx)
    y = (y + u * self.D.float()) * F.silu(gate)
    return self.out_proj(y.to(dtype))


def selective_scan(
    dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, u: torch.Tensor, rate: torch.Tensor, ctx: CallContext
) -> torch.Tensor:
    """Mamba1's ``C . h`` per token over the whole sequence, on this rank's shard (Note [Mamba1 state]).

    Args:
        dt: ``[B, L, D]`` the time steps (softplus applied).
        b: ``[B, L, N]`` the drive's input projection.
        c: ``[B, L, N]`` the read-out.
        u: ``[B, L, D]`` the scan's input.
        rate: ``[D, N]`` ``A = -exp(A_log)``, float32. With heads (Zamba's), every ``D`` above is ``H, D/H`` and
            ``b``, ``c`` are ``[B, L, H, N]``: each head an independent Mamba1 with its own B and C.
        ctx: the call context.

    Returns:
        ``C . h`` per token, of ``u``'s shape.
    """

    def run(dt, b, c, u, initial_state):
        return _scan_piece(dt, b, c, u, rate, initial_state)

    def opening(dt, b, c, u):  # the state decays by exp(A sum(dt)) (Note [Mamba1 state])
        out, local = run(dt, b, c, u, initial_state=None)
        elapsed = torch.cumsum(dt.float(), dim=1)  # [n, T, D]: the steps up to each token

        def respond(entering):  # [n, D * N, 1, 1] -> [n, T, D]
            return _Carried.apply(elapsed, c, rate, entering.reshape(-1, *rate.shape))

        return Opening(out, local, torch.exp(rate * elapsed[:, -1, ..., None]).flatten(1)[..., None, None], respond)

    return chunked_state_scan(run, opening, (dt, b, c, u), (rate.numel(), 1, 1), ctx.mesh, ctx.layout, ctx.mask)


def zamba_mamba_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: object | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``ZambaMambaMixer.forward`` on this rank's shard: Mamba1 in ``n_mamba_heads`` heads, each with its own x and
    dt projections (so its own B and C), the convolution and the scan's state exchanged (Note [Mamba1 state]).

    Args:
        self: the layer (``in_proj``, ``conv1d``, ``x_proj_weight``, ``dt_proj_weight``, ``dt_proj_bias``,
            ``A_log``, ``D``, ``out_proj``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = adapter_context(self, cache, kwargs, silu=False)  # the layer's own activation is applied below
    dtype, (batch, length, _) = hidden_states.dtype, hidden_states.shape
    heads, width, entries = self.n_mamba_heads, self.mamba_head_dim, self.ssm_state_size
    projected = self.in_proj(hidden_states).unflatten(-1, (-1, 2))  # x and gate interleaved, channel by channel
    x, gate = projected[..., 0], projected[..., 1]
    conv = layer_conv(self, x.transpose(1, 2), self.conv1d, ctx, bias=self.use_conv_bias)
    u = self.act(conv).reshape(batch, heads, width, length).transpose(0, 1)  # [heads, B, D/H, L], as the model's
    params = (self.x_proj_weight[:, None] @ u).permute(1, 3, 0, 2)  # [B, L, heads, R + 2N]
    step, b, c = torch.split(params, [self.time_step_rank, entries, entries], dim=-1)
    dt = (self.dt_proj_weight[:, None] @ step.permute(2, 0, 3, 1)).permute(1, 3, 0, 2)  # [B, L, heads, D/H]
    dt = F.softplus(dt + self.dt_proj_bias.float().to(dt.dtype))
    u = u.permute(1, 3, 0, 2)  # [B, L, heads, D/H]
    y = selective_scan(dt, b, c, u, -torch.exp(self.A_log.float()), ctx)
    gate = gate.reshape(batch, length, heads, width)
    y = (y + u * self.D.float()) * F.silu(gate)
    return self.out_proj(y.flatten(2).to(dtype))
