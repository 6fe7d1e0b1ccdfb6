"""FlexAttention under ``seqpar.context_parallel``: ``seqpar.flex_attention`` on the shards, by ``seqpar.attention``.

A BlockMask built on the whole sequence becomes a blockwise ``SequenceMask``; tanh soft-capping is the one score_mod.

Note [flex under context_parallel]
    Where the call is met. torch's ``flex_attention`` is a Python function, not a torch function, so a
    TorchFunctionMode (Note [SDPA interception]) never sees the call itself; it first meets the
    FlexAttention operator the function ends in, and torch reaches that operator inside a region it
    compiles with dynamo (eagerly too, and under ``torch.compile(flex_attention)``), which traces the mode
    instead of running it: no collective can run there. Before that, on the CPU, torch refuses inputs that
    require grad (it has no CPU flex backward). So the served door is ``seqpar.flex_attention``: torch's
    signature, an overridable torch function (``torch.overrides.handle_torch_function``) that the block
    serves before any torch check, eagerly, on every device and with grad, and that is torch's
    ``flex_attention`` outside a block; models change one import, as for ``context_parallel``. torch's own
    ``flex_attention`` reaching the operator inside a block is refused with a message naming that import
    (raised while dynamo traces, so it surfaces as dynamo's ``Unsupported`` carrying it), on every rank
    alike, before any collective.

    The mask contract. The model builds its BlockMask once per batch, before the block, on the whole
    sequence: ``create_block_mask(mask_mod, B or None, None, S, S)`` with global ``q_idx`` / ``kv_idx``
    (document ids, windows, prefixes of the unsharded batch), exactly as on one process. Passed in
    ``buffers`` (its ``buffer_seq_dims`` entry is ignored) it is sharded in place like the tensors: inside
    the block its lengths are the shard's, ``(S/P, S/P)``, so that torch's checks pass, and its
    ``mask_mod`` is a ``ShardMaskMod`` that names the whole-sequence mask (calling it calls the original
    ``mask_mod`` on global indices); its block tables stay those of the whole sequence; on exit both are
    put back. ``seqpar.flex_attention`` also takes a whole-sequence BlockMask that is not in ``buffers``
    (lengths ``(S, S)``). A BlockMask built inside the block (on the shards' local indices) is refused: a
    local index says nothing about where a token is in the sequence under the zigzag layout.

    What runs. The whole-sequence mask becomes a ``SequenceMask`` (``flex_masks``), once per batch (kept
    with the BlockMask for the block's lifetime, so the layers that share it share its plans): causal
    packed documents with or without a sliding window where the mask is exactly that (Note [flex masks
    recognised]), otherwise a blockwise mask (Note [blockwise masks]) whose block table (BLOCK_SIZE of the
    BlockMask, head 0) decides which tiles every strategy skips or runs unmasked and whose ``mask_mod`` is
    evaluated on the global ``(q_idx, kv_idx)`` grid of each masked tile the strategy computes; when it
    shows nothing above the diagonal the call also runs with ``causal=True`` (zigzag balance, the causal
    chunk plan). A call without a ``block_mask`` is full (non-causal) attention over the whole sequence. The mask
    must not depend on the head (a BlockMask with more than one head is refused): one table serves every
    strategy's head split. ``score_mod``: ``softcap_score_mod(c)`` runs as ``seqpar.attention(softcap=c)``; any
    other is probed on sample scores at sample indices (1024 draws over the batch, heads and sequence, both
    ends included): ``softcap * tanh(score / softcap)`` written by hand (Gemma 2) runs the same way, the
    identity as no score_mod, anything else (ALiBi, relative biases) is refused. A probe is a sample: a
    score_mod that departs from soft-capping at a few index pairs only could pass it (use the factory, or
    seqpar.attention, for certainty). Refusals are
    ``SeqparInputError`` on every rank, agreed before any collective. The log-sum-exp and max scores are
    not returned (``return_lse`` / ``return_aux`` are refused); ``kernel_options`` are torch's kernel
    settings and are ignored (seqpar picks its kernels).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.overrides
from torch.nn.attention import flex_attention as torch_flex

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.api import attention
from seqpar.sequence_parallel.context_parallel.flex_masks import blockwise_mask, sequence_mask_of
from seqpar.sequence_parallel.context_parallel.sdpa_mode import SequenceParallelSDPA, agree_or_raise
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask

_FLEX_HOP = getattr(torch.ops.higher_order, "flex_attention", None)  # the operator torch's flex ends in

_TORCH_DOOR = (
    "seqpar.context_parallel: torch's flex_attention cannot be served inside the block (torch compiles its "
    "operator call, and a compiled region cannot run seqpar's collectives; on the CPU it also refuses inputs that "
    "require grad): import flex_attention from seqpar instead (from seqpar import flex_attention), the same "
    "signature, which runs torch's outside a block"
)

BLOCK_MASK_PROBLEMS = (
    "a BlockMask in buffers does not cover the buffers' sequence (build it with create_block_mask on the whole "
    "sequence: Q_LEN = KV_LEN = the buffers' sequence length)",
    "a BlockMask in buffers depends on the head (built with H > 1); build it with H=None",
    "the same BlockMask appears twice in buffers, or is already sharded by an enclosing block",
)

_FLEX_PROBLEMS = (
    "score_mod is not served under seqpar.context_parallel: only tanh soft-capping (softcap * tanh(score / "
    "softcap), e.g. seqpar.sequence_parallel.context_parallel.softcap_score_mod(c)) has a seqpar equivalent",
    "block_mask was built on the shards, not on the whole sequence: build it before the block with "
    "create_block_mask on the global sequence (Q_LEN = KV_LEN = the global length) and pass it in buffers",
    "block_mask depends on the head (built with H > 1); build it with H=None",
    "block_mask's batch is neither 1 nor the query batch",
    "query, key and value must be [B, H, S/P, D] with key/value heads dividing the query heads (enable_gqa=True)",
    "return_lse / return_aux are not served under seqpar.context_parallel (the log-sum-exp is not returned)",
)


def softcap_score_mod(softcap: float) -> Callable:
    """The ``score_mod`` of tanh logit soft-capping (Gemma 2), which the block serves as ``softcap=``.

    Recognised by its origin, without probing (Note [flex under context_parallel]).

    Args:
        softcap: the cap; scores become ``softcap * tanh(score / softcap)``.

    Returns:
        A FlexAttention ``score_mod``.
    """

    def score_mod(score, batch, head, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    score_mod.seqpar_softcap = float(softcap)
    return score_mod


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None = None,
    block_mask: torch_flex.BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: object = None,
) -> object:
    """torch's ``flex_attention``, served across the ranks inside ``seqpar.context_parallel`` on every device.

    Outside a block it is torch's ``flex_attention``. Inside, ``query``/``key``/``value`` are this rank's
    shards and ``block_mask`` a whole-sequence BlockMask (Note [flex under context_parallel]); the call
    runs ``seqpar.attention`` with the block's strategy and layout, forward and backward.

    Args:
        query: ``[B, H, S/P, D]`` inside a block.
        key: ``[B, H_kv, S/P, D]``.
        value: ``[B, H_kv, S/P, D_v]``.
        score_mod: None, or tanh soft-capping (``softcap_score_mod``) inside a block.
        block_mask: a BlockMask built on the whole sequence (in the block's ``buffers`` or not), or None.
        scale: softmax scale; ``1 / sqrt(D)`` by default.
        enable_gqa: key/value heads may divide the query heads.
        return_lse: as torch's (refused inside a block).
        kernel_options: as torch's (ignored inside a block).
        return_aux: as torch's (refused inside a block).

    Returns:
        ``[B, H, S/P, D_v]``: this rank's shard of the output (outside a block: what torch returns).

    Raises:
        SeqparInputError: inside a block, on every rank, for a score_mod other than soft-capping, a mask
            built on the shards or per head, mismatched shapes, or a request for the log-sum-exp.
    """
    args = (query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options)
    if torch.overrides.has_torch_function((query, key, value)):
        return torch.overrides.handle_torch_function(flex_attention, (query, key, value), *args, return_aux=return_aux)
    return torch_flex.flex_attention(*args, return_aux=return_aux)


class ShardMaskMod:
    """The ``mask_mod`` of a BlockMask while a block holds it sharded: names the whole-sequence mask.

    Calling it calls the original ``mask_mod`` (global indices).
    """

    def __init__(self, block_mask: torch_flex.BlockMask) -> None:
        self.block_mask, self.original = block_mask, block_mask.mask_mod
        self.seq_lengths = block_mask.seq_lengths
        self.masks: dict[tuple, tuple[SequenceMask, bool]] = {}

    def __call__(self, b, h, q_idx, kv_idx):
        return self.original(b, h, q_idx, kv_idx)


def _is_block_mask(x: object) -> bool:
    return isinstance(x, torch_flex.BlockMask)


def split_block_masks(buffers: list, dims: list) -> tuple[list, list, list]:
    """``(tensors, their dims, block masks)`` of a ``buffers`` list (lists of unequal length are left whole)."""
    if len(buffers) != len(dims) or not any(_is_block_mask(b) for b in buffers):
        return buffers, dims, []
    kept = [(b, d) for b, d in zip(buffers, dims) if not _is_block_mask(b)]
    return [b for b, _ in kept], [d for _, d in kept], [b for b in buffers if _is_block_mask(b)]


def block_mask_problem(masks: list, length: int | None) -> tuple[int, str] | None:
    """This rank's problem with the BlockMasks of ``buffers`` (index into ``BLOCK_MASK_PROBLEMS``), or None.

    Args:
        masks: the BlockMasks passed in ``buffers``.
        length: the tensors' sequence length (None when no tensor is passed).
    """
    for i, m in enumerate(masks):
        q_len, kv_len = m.seq_lengths
        if q_len != kv_len or (length is not None and q_len != length):
            return 0, f"BlockMask {i} covers {q_len} x {kv_len}, the buffers {length}: {BLOCK_MASK_PROBLEMS[0]}"
        if m.kv_num_blocks.shape[1] != 1:
            return 1, f"BlockMask {i}: {BLOCK_MASK_PROBLEMS[1]}"
        if isinstance(m.mask_mod, ShardMaskMod) or any(m is other for other in masks[:i]):
            return 2, f"BlockMask {i}: {BLOCK_MASK_PROBLEMS[2]}"
    return None


def block_mask_signature(masks: list) -> int:
    """An integer every rank must agree on: the masks' lengths and block sizes."""
    return hash(tuple((*m.seq_lengths, *m.BLOCK_SIZE, *m.kv_num_blocks.shape) for m in masks))


@contextlib.contextmanager
def shard_block_masks(masks: Sequence[torch_flex.BlockMask], sp: SequenceParallelMesh) -> Iterator[None]:
    """Hold ``masks`` sharded for a block: lengths ``(S/P, S/P)``, a ``ShardMaskMod``; put back on exit."""
    held = []
    try:
        for m in masks:
            shard = ShardMaskMod(m)
            held.append(shard)
            m.seq_lengths = tuple(n // sp.sp_size for n in m.seq_lengths)
            m.mask_mod = shard
        yield
    finally:
        for shard in held:
            shard.block_mask.seq_lengths, shard.block_mask.mask_mod = shard.seq_lengths, shard.original


def _softcap_of(score_mod: Callable | None, sizes: tuple[int, int, int]) -> tuple[bool, float | None]:
    """``(served, softcap)`` of a ``score_mod``: seqpar's own, or probed on sample scores at sample indices
    over ``sizes`` = (batch, heads, sequence) (Note [flex under context_parallel])."""
    if score_mod is None:
        return True, None
    if isinstance(getattr(score_mod, "seqpar_softcap", None), float):
        return True, score_mod.seqpar_softcap
    gen = torch.Generator().manual_seed(0)
    n = 1024
    index = [torch.randint(0, max(size, 1), (n,), generator=gen, dtype=torch.int32) for size in (*sizes, sizes[2])]
    for i, size in zip(index, (*sizes, sizes[2])):  # both ends of every range
        i[0], i[-1] = 0, max(size, 1) - 1
    try:
        with torch.no_grad():
            far = score_mod(torch.full((n,), 1e4), *index).double()
            cap = float(far[0])
            span = 3 * cap if math.isfinite(cap) and 0 < cap < 1e3 else 30.0
            score = torch.linspace(-span, span, n, dtype=torch.float64)
            got = score_mod(score.float(), *index).double()
    except Exception:  # a score_mod that does not run elementwise on tensors is not one seqpar knows
        return False, None
    if got.shape != score.shape or far.shape != score.shape:
        return False, None
    if torch.allclose(got, score.float().double(), rtol=1e-6, atol=1e-6):
        return True, None
    capped = cap * torch.tanh(score / cap) if 0 < cap < 1e3 else None
    flat = capped is not None and torch.allclose(far, torch.full_like(far, cap), rtol=1e-5, atol=1e-5)
    if flat and torch.allclose(got, capped, rtol=1e-5, atol=1e-5 * cap):
        return True, cap
    return False, None


class SequenceParallelFlex(SequenceParallelSDPA):
    """``SequenceParallelSDPA`` that also serves FlexAttention (Note [flex under context_parallel]).

    Keeps, for the block's lifetime, the ``SequenceMask`` of each whole-sequence BlockMask it has met.
    """

    def __init__(self, mesh: SequenceParallelMesh, strategy: str, layout: str, *, seq_len: int | None = None) -> None:
        super().__init__(mesh, strategy, layout, seq_len=seq_len)
        self.unheld: dict[int, ShardMaskMod] = {}  # whole-sequence BlockMasks not in buffers, by id

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is flex_attention:
            return self.flex(*args, **kwargs)
        if _FLEX_HOP is not None and func is _FLEX_HOP:
            return self.flex_operator(*args, **kwargs)
        return super().__torch_function__(func, types_, args, kwargs)

    def flex_operator(self, *args, **kwargs):
        """torch's ``flex_attention`` reaches the FlexAttention operator inside a region it compiles, which
        traces this mode and cannot run seqpar's collectives: refused, naming the import that is served."""
        raise SeqparInputError(_TORCH_DOOR)

    def flex(
        self,
        query,
        key,
        value,
        score_mod=None,
        block_mask=None,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        kernel_options=None,
        *,
        return_aux=None,
    ) -> torch.Tensor:
        """``seqpar.flex_attention`` inside the block."""
        mask_mod = None if block_mask is None else block_mask.mask_mod
        wants = bool(return_lse) or return_aux is not None
        return self._serve(query, key, value, score_mod, mask_mod, block_mask, scale, enable_gqa, wants)

    def _mask(self, mask_mod: object, block_mask: object, seq: int) -> ShardMaskMod | int | None:
        """The whole-sequence mask of a call: a ``ShardMaskMod``, None (no mask) or a problem code."""
        if mask_mod is None or mask_mod is torch_flex.noop_mask:
            return None
        if isinstance(mask_mod, ShardMaskMod):
            return mask_mod
        if block_mask is not None and tuple(block_mask.seq_lengths) == (seq, seq):  # seqpar.flex_attention's door
            if id(block_mask) not in self.unheld or self.unheld[id(block_mask)].block_mask is not block_mask:
                self.unheld[id(block_mask)] = ShardMaskMod(block_mask)
            return self.unheld[id(block_mask)]
        return 1

    def _serve(self, query, key, value, score_mod, mask_mod, block_mask, scale, enable_gqa, wants_lse):
        seq = query.shape[-2] * self.mesh.sp_size
        shard = self._mask(mask_mod, block_mask, seq)
        served, softcap = _softcap_of(score_mod, (query.shape[0], query.shape[1], seq))
        problem = None
        if not served:
            problem = 0, _FLEX_PROBLEMS[0]
        elif isinstance(shard, int):
            problem = shard, _FLEX_PROBLEMS[shard]
        elif shard is not None and tuple(shard.seq_lengths) != (seq, seq):
            problem = 1, f"{_FLEX_PROBLEMS[1]} (it covers {shard.seq_lengths}, the sequence has {seq} tokens)"
        elif shard is not None and shard.block_mask.kv_num_blocks.shape[1] != 1:
            problem = 2, _FLEX_PROBLEMS[2]
        elif shard is not None and shard.block_mask.kv_num_blocks.shape[0] not in (1, query.shape[0]):
            problem = 3, f"{_FLEX_PROBLEMS[3]}: {shard.block_mask.kv_num_blocks.shape[0]} vs {query.shape[0]}"
        elif query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[1] % key.shape[1]:
            problem = 4, f"{_FLEX_PROBLEMS[4]}; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        elif key.shape[1] != query.shape[1] and not enable_gqa:
            problem = 4, f"{_FLEX_PROBLEMS[4]}; key/value heads {key.shape[1]}, query heads {query.shape[1]}"
        elif wants_lse:
            problem = 5, _FLEX_PROBLEMS[5]
        agree_or_raise(self.mesh.sp_group, "seqpar.context_parallel: flex_attention", problem, _FLEX_PROBLEMS)
        if shard is None:
            mask, causal = None, False
        else:
            key_ = (query.shape[0], str(query.device))
            if key_ not in shard.masks:
                whole = blockwise_mask(shard.block_mask, query.shape[0], shard.original, shard.seq_lengths)
                shard.masks[key_] = sequence_mask_of(whole)
            mask, causal = shard.masks[key_]
        return attention(
            query,
            key,
            value,
            mesh=self.mesh,
            strategy=self.strategy,
            causal=causal,
            layout=self.layout,
            scale=scale,
            mask=mask,
            softcap=softcap,
        )
