"""A hybrid model's layers in the memory estimate: what each kind of layer keeps per token, and its mixer's exchange.

``activations.py`` asks this for hybrid models; each mixer's own terms are its row's (Note [mixer rows]).

Note [hybrid memory]
    Per token, in elements, a hybrid's layer keeps for its backward (its input left out, as in Note [memory
    estimate]) its norms' and residuals' tensors and the mixer's input (5H; in a Mamba2 layer the input
    multiplier's copy of it), its MLP's (4I, as Llama's, or the experts' with a gated shared expert's output,
    Note [mixture-of-experts sizes]), and its token mixer's:
    * attention: Llama's ``3 Hq + 2 Hkv``; ``2 Hq + 2 Hkv`` without a rotary embedding (``ModelSizes.rotary``
      from ``Family.rotary``: GraniteMoeHybrid, Jamba, Nemotron-H); MLA's terms of Note [memory estimate] (Kimi Linear);
      ``5 Hq + 3 Hkv`` with per-head q/k norms (LFM2: q and k before and after their norms);
      ``8 Hq + 4 Hkv`` with those norms and Qwen3-Next's output gate (the gate half of ``q_proj``, its
      sigmoid, the gated output, the norms' extra copies).
    * gated DeltaNet (Hv value heads, dk, dv, ``V_k = Hv dk``, ``V_v = Hv dv``, conv width K over
      ``C_conv = 2 Hk dk + Hv dv`` channels): around the kernel, the convolution's input and output
      (``2 C_conv``), the gated norm's five ``V_v``-wide tensors and ``out_proj``'s input (``6 V_v``), beta,
      a and the decay (3 Hv); inside ``torch_chunk_gated_delta_rule``, which computes in float32 whatever
      the dtype, ``G(dv) = 5 Hv c + 12 V_k + 3 V_v + 7 Hv + Hv dk dv / c`` with its chunk length c = 64:
      five ``c x c`` matrices a head per chunk (the pairwise decays, the UT system, the intra-chunk
      attention, their products), the keys and queries repeated to the value heads, normalised, scaled and
      decayed (12 ``V_k``), and one state a chunk.
    * KDA (Kimi Linear; h heads of d = dk = dv, ``C_conv = 3 h d``): around the kernel as gated DeltaNet;
      inside ``chunk_kimi_delta_attention`` (float32), whose decay is a vector a key channel, per head
      ``K(dv) = c^2 / 3 + 2 c + dk (3 c + 12) + 3 dv + 7 + dk dv / c``: the UT system's row-by-row updates
      (``c^3 / 3`` elements a chunk), the ``c x c`` system and scores, the pairwise decays a channel and
      their two products with the keys (``3 c dk``), as ``G`` otherwise.
    * Mamba2 / SSD (Hm heads of d_head, ``I_m = Hm d_head``, G groups of state size N, the SSD chunk
      length c): around the kernel, ``in_proj``'s output (``2 I_m + 2 G N + Hm``), the convolution's input,
      output and activation (``3 C_conv``, ``C_conv = I_m + 2 G N``), the gated norm's and ``out_proj``'s
      tensors (``5 I_m``; ``2 I_m`` for Falcon-H1's plain gate, no norm) and 3 Hm; inside
      ``mamba2_chunk_scan`` (float32) ``S = 4 I_m + 3 Hm c + 5 Hm N + 2 Hm d_head N / c + 5 Hm``: the
      discretised inputs, the ``c x c`` decays and scores a head, B and C repeated to the heads, two states
      a chunk.
    * Mamba1 (I channels, state N, dt rank R; seqpar's own sequential scan, Note [Mamba1 state]): around
      the scan, ``in_proj``'s output (2I), the convolution's input, output and activation, the read-out's
      and gate's tensors (7 I with the convolution's input), ``x_proj``'s output (``R + 2N``, twice and 3
      more with Falcon-Mamba's norms on dt, B and C); the scan's decay, drive and each step's state
      (``3 I N``, float32) and dt's three float32 I-wide tensors. A layer of a pure state-space model (one
      norm, no MLP) keeps 2H for its norm and residual instead of 5H.
    * MiniMax's lightning attention (h heads of d, seqpar's blocked recurrence over blocks of b tokens, Note
      [lightning blocks]): around it ``qkv_proj``'s output, q, k and v, the norm's, gate's and output's tensors
      (``12 H + 1``); inside, per block, the keys transposed, the queries, the decayed ``b x b`` scores and the
      state entering the block: ``h (2 d + b + d^2 / b)`` per token, float32.
    * LFM2's short convolution: ``in_proj``'s output (3H), the convolution's input and output, and
      ``out_proj``'s input (3H): 6H, so an LFM2 conv layer keeps ``11 H + 4 I`` besides its input.
    * Falcon-H1's layer: SSD's, the attention's (Llama's) and the attention input's scaled copy (H).
    * Nemotron-H's layers hold one norm (2H) and one of Mamba2, attention (no rotary), an MLP (ReLU^2: its
      up projection's output and its square, 2I) or experts (the routed copies and outputs, ``2 k H``, and
      2 of each expert's and the shared expert's width).
    * Zamba2's shared block (before its layer's Mamba2): the hidden state joined with the embeddings and its
      norm (4H), the attention over the ``2 H`` inputs (``4 Hq + 2 Hkv``: the adapted queries add a copy),
      the adapters' rank-r tensors (4r, r without the attention adapters), the MLP's norm, its 4I, the
      projection's input and the Mamba2 norm's input (4H).
    Under sp > 1 a rank's chunks continue the state of chunks on other ranks (Note [state passing]): a chunk's
    opening piece runs once and keeps what reads the state that reaches it. The gated delta rule runs it with
    ``dk`` more value columns, ``G(dv + dk) + Hv dk`` (``K(dv + dk) + Hv dk``; the identity's reads kept); SSD
    keeps ``S + Hm N + I_m + 4 Hm`` (C repeated to the heads, the read, the decays), Mamba1 ``2 I N`` more (the
    decays' running product, the decayed state), lightning attention ``h d`` more (the decayed queries). The
    busiest rank (every chunk opening) is counted; packed documents shorten the opening pieces. The convolution of a
    16-bit model sums in float32: each of its K taps keeps a float32 copy (``K C_conv`` at 4 bytes in place
    of ``C_conv``); the kernels' tensors are counted at 4 bytes (an upper bound: at bf16 some are bf16).
    Counted with saved-tensor hooks on real layers under ``prepare_model`` (float32, one process; the tensors
    the graph still holds after the forward): ``tests/test_estimate.py`` checks each kind of layer within 7%
    (measured -5.2% to +6.6%; pure state-space models within 5%, at two lengths; Jamba's layers together
    within 6%).
    Exchange, per mixer layer and rank, forward (its backward, a reduce-scatter, moves as much): the halo's
    tails, ``chunks x rows x C_conv x (K - 1)`` in the dtype, and the state summaries (gated DeltaNet, KDA
    and Mamba1, whose ``I N`` heads each have a 1 x 1 state), ``chunks x rows x heads x dk x (dk + dv)``
    float32 (``M`` next to ``S_loc``); SSD's and lightning attention's ``M`` is a decay times the identity,
    and only the decay travels: ``chunks x rows x heads x (1 + dk dv)`` (SSD's dk is d_head, its dv N). The
    all-gather hands every rank sp of each, which the layer holds while its backward runs. Gloo's ring
    all-gather sends ``(sp - 1)`` pieces of a rank's size, as does the reduce-scatter.
"""

from __future__ import annotations

from seqpar.models import ModelSizes
from seqpar.models.hybrid_sizes import ATTENTION, MLP_KINDS, PARALLEL, SHARED


def _attention(d: ModelSizes) -> int:
    """A hybrid's attention layer's mixer elements per token (Note [hybrid memory])."""
    hq, hkv = d.q_width, d.kv_width
    if d.mla:  # Kimi Linear: Note [memory estimate]'s MLA terms
        return 4 * hq + d.v_width + 3 * (d.q_lora_rank + d.kv_lora_rank + d.qk_rope_head_dim)
    if d.attention_gate:
        return 8 * hq + 4 * hkv
    if d.qk_norm:
        return 5 * hq + 3 * hkv
    return (3 if d.rotary else 2) * hq + 2 * hkv


def _shared_block(d: ModelSizes) -> int:
    """Elements per token a Zamba2 shared block keeps (Note [hybrid memory]): its input joined with the embeddings
    and their norm (``4 H``), the attention over them (``4 Hq + 2 Hkv``), the adapters' low-rank tensors, the
    MLP's norm and tensors, the projection's input and the Mamba2 norm's input (``4 H + 4 I``)."""
    rank = d.shared.adapter_rank * (4 if d.shared.attention_adapters else 1)
    return 8 * d.hidden_size + 4 * d.q_width + 2 * d.kv_width + rank + 4 * d.dense_width


def mixer_elements(d: ModelSizes, kind: str, sp_size: int, b: int) -> tuple[float, float]:
    """Elements one token keeps in a hybrid's layer of ``kind`` for its backward, its MLP and input left out.

    Args:
        d: the model's sizes (a hybrid's, Note [hybrid sizes]).
        kind: the layer's role, one of ``ModelSizes.layer_kinds``.
        sp: sequence-parallel degree (the state passing's opening pieces when above 1).
        b: bytes per element of the model's dtype.

    Returns:
        (elements in the model's dtype, float32 elements), per token (Note [hybrid memory]).
    """
    norms = (5 if d.layer_norms == 2 else 2) * d.hidden_size  # one norm: its output and the residual's input
    if kind == ATTENTION:
        return float(norms + _attention(d)), 0.0
    if kind in MLP_KINDS:  # Nemotron-H: an MLP or experts alone in a layer
        return float(norms + mlp_elements(d, kind)), 0.0
    channels, width = d.mixer.conv(d.hidden_size)
    taps = (float(channels) if b >= 4 else 0.0, 0.0 if b >= 4 else float(width * channels))  # Note [hybrid memory]
    own, float32 = d.mixer.elements(d.hidden_size, sp_size)  # the row's terms (Note [mixer rows])
    own, float32 = norms + own + taps[0], float32 + taps[1]
    if kind == SHARED:  # Zamba2: the shared block, then its Mamba2 layer
        return own + _shared_block(d), float32
    if kind == PARALLEL:  # Falcon-H1: the attention's own, and its input's scaled copy, beside SSD's
        return own + _attention(d) + d.hidden_size, float32
    return own, float32


def mlp_elements(d: ModelSizes, kind: str) -> int:
    """Elements one token keeps in an MLP ("mlp") or experts ("moe") for its backward (Note [hybrid memory])."""
    per_width = 4 if d.mlp_gated else 2  # SwiGLU's gate, up, activation and product; ReLU^2's up and square
    if kind == "mlp":
        return per_width * d.dense_width
    routed = 2 * d.num_experts_per_tok * d.hidden_size  # the routed copies and weighted outputs
    gate = d.hidden_size if d.shared_width and d.shared_expert_gate else 0
    return per_width * (d.num_experts_per_tok * d.expert_width + d.shared_width) + routed + gate


def exchange_bytes(d: ModelSizes, kind: str, rows: int, chunks: int, b: int) -> tuple[int, int]:
    """What one rank hands the all-gathers of one ``kind`` layer's forward (Note [hybrid memory]).

    Args:
        d: the model's sizes.
        kind: the layer's role, one of ``ModelSizes.layer_kinds`` (attention and MLPs exchange nothing here).
        rows: rows of the micro-batch.
        chunks: layout chunks each rank holds.
        b: bytes per element of the model's dtype.

    Returns:
        (halo tail bytes, state summary bytes) of this rank's pieces; each all-gather returns sp times as many.
    """
    if kind == ATTENTION or kind in MLP_KINDS:
        return 0, 0
    channels, width = d.mixer.conv(d.hidden_size)
    return chunks * rows * channels * (width - 1) * b, d.mixer.exchange(rows, chunks)
