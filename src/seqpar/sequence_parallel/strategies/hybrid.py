"""Hybrid attention on a 2-D group: Ulysses all-to-all inside (fast links) x ring attention outside.

The head count caps only the Ulysses degree, and the ring carries 1/U of the bytes a flat ring would.

Note [hybrid layout]
    SP rank s = ring_rank * U + ulysses_rank holds the layout's chunks of s. The Ulysses all-to-all gathers
    the chunks of the U members of a ring rank's group (sorted into global order, so the ring sees
    contiguous runs) for H/U heads; ring rank j then holds the union of its members' chunks, and ring
    attention runs over those chunk ids (Note [block plan]). With the zigzag layout the union is two
    contiguous runs, a zigzag at the ring level, so causal work stays balanced. KV heads fewer than U are
    replicated for the all-to-all only (Note [ulysses heads]); the ring carries what each rank then holds.
    A ulysses axis that does not split the heads evenly takes the uneven split (Note [uneven heads]); the
    ring members of one ulysses rank hold the same head range, so the ring runs on it unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm import head_to_seq_ranges, head_to_seq_shards, seq_to_head_shards
from seqpar.sequence_parallel.kernels import AttentionKernel
from seqpar.sequence_parallel.kernels.sinks import head_slice
from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.strategies.heads import head_split
from seqpar.sequence_parallel.strategies.ring import ring_attention_on_chunks
from seqpar.sequence_parallel.strategies.ulysses import repeat_kv_heads, uneven_head_exchange


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SequenceParallelMesh,
    layout: str,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses x ring attention (Note [hybrid layout]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``, sharded with ``layout`` over P = R x U SP ranks.
        mesh: its ring group holds the R ranks that share an ulysses rank (the SP group when it has none),
            its ulysses group the U ranks of one ring rank (None: U = 1), and this rank's SP rank must be
            ``ring_rank * U + ulysses_rank`` (``seqpar.make_mesh`` builds it so).
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]); the ring runs those of this rank's heads.

    Returns:
        ``[B, H, S/P, D]`` local output.

    Raises:
        SeqparInputError: groups whose ranks do not follow ``sp_rank = ring_rank * U + ulysses_rank``.
    """
    ring_group = mesh.ring_group if mesh.ring_group is not None else mesh.sp_group
    ulysses_group, sp_rank = mesh.ulysses_group, mesh.sp_rank
    ring_size, ring_rank = dist.get_world_size(ring_group), dist.get_rank(ring_group)
    u_size = 1 if ulysses_group is None else dist.get_world_size(ulysses_group)
    u_rank = 0 if ulysses_group is None else dist.get_rank(ulysses_group)
    if sp_rank != ring_rank * u_size + u_rank:
        raise SeqparInputError(
            f"hybrid needs sp_rank = ring_rank * ulysses_size + ulysses_rank; got {sp_rank} != "
            f"{ring_rank} * {u_size} + {u_rank} (build the mesh with seqpar.make_mesh)"
        )
    sp_ids = rank_chunk_ids(layout, ring_size * u_size)
    per_sp = len(sp_ids) // (ring_size * u_size)

    def members(j: int) -> list[int]:  # chunk ids of ring rank j's Ulysses group, rank-major
        return list(sp_ids[j * u_size * per_sp : (j + 1) * u_size * per_sp])

    ring_ids = tuple(tuple(sorted(members(j))) for j in range(ring_size))
    options = dict(group=ring_group, chunk_ids=ring_ids, causal=causal, scale=scale, kernel=kernel, mask=mask)
    if u_size == 1:
        return ring_attention_on_chunks(q, k, v, sinks=sinks, **options)
    mine = torch.tensor(members(ring_rank))
    to_natural = mine.argsort().to(q.device)
    to_owner = to_natural.argsort()
    split = head_split(q.shape[1], k.shape[1], u_size)
    if not split.even:  # Note [uneven heads]
        start, stop = split.q_ranges[u_rank]
        qh, kh, vh = uneven_head_exchange(q, k, v, split, ulysses_group, u_rank, to_natural, to_owner)
        out = ring_attention_on_chunks(qh, kh, vh, sinks=None if sinks is None else sinks[start:stop], **options)
        return head_to_seq_ranges(out, ulysses_group, to_natural, to_owner, split.q_ranges, q.shape[1])
    k, v = repeat_kv_heads(q, k, v, u_size)
    qh, kh, vh = (seq_to_head_shards(t, ulysses_group, to_natural, to_owner) for t in (q, k, v))  # [B, H/U, S/R, D]
    out = ring_attention_on_chunks(qh, kh, vh, sinks=head_slice(sinks, u_rank, u_size), **options)
    return head_to_seq_shards(out, ulysses_group, to_natural, to_owner)
