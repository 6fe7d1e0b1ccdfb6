"""The sizes of MLA attention read from a config: the latent ranks and head sizes ``ModelSizes`` counts.

``ModelSizes`` (``sizes.py``) reads these for the families whose MLA layers were checked (``Family.mla``).

Note [MLA sizes]
    MLA attention (DeepSeek-V2/V3, MiniCPM3) projects the queries through a rank-``r_q`` bottleneck
    (``q_a_proj``, an RMSNorm, ``q_b_proj``; a plain ``q_proj`` when ``q_lora_rank`` is None) and the keys
    and values through one shared latent: ``kv_a_proj_with_mqa`` makes ``r_kv`` latent plus ``d_rope``
    rotary key columns, an RMSNorm, ``kv_b_proj`` expands the latent to every head's ``d_nope`` key and
    ``d_v`` value columns, and ``o_proj`` reads ``heads x d_v``. Queries and keys have
    ``d_qk = d_nope + d_rope`` columns per head, and every head has its own keys and values after the
    expansion. seqpar pads the values to ``d_qk`` (Note [value head size]), so the attention seqpar runs is
    a plain multi-head attention of ``heads`` heads of ``d_qk``: ``ModelSizes.dim`` is ``d_qk`` and the
    key/value heads are the query heads, which makes the communication sizes and attention FLOPs those of
    the padded tensors seqpar moves. The projections' weights are counted exactly (the two latent norms
    included), as ``parameter_counts`` of the built model. Only the model types whose layers were checked
    so are read (``Family.mla``: DeepSeek-V2/V3, MiniCPM3, and Kimi Linear's MLA layers beside its KDA layers,
    Note [hybrid sizes]); other MLA configs (DSA indexers) are refused with the reason.
"""

from __future__ import annotations

from seqpar.errors import SeqparInputError


def mla_fields(get, checked: tuple[str, ...]) -> dict:
    """The MLA fields of ``ModelSizes`` (Note [MLA sizes]) of a config whose model type is one of ``checked`` (the
    families whose MLA layers it describes); none when the attention is not MLA."""
    if not get("kv_lora_rank") and not get("v_head_dim"):
        return {}
    if get("model_type") not in checked:  # DSA indexers, KDA hybrids, other layer shapes around MLA
        raise SeqparInputError(
            f"MLA attention of model type {get('model_type')!r}: seqpar's sizes describe the MLA layers of "
            f"{', '.join(checked)} only, so its memory estimate and plans could be wrong for this model; "
            "training under seqpar is not affected (Note [value head size])"
        )
    names = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    fields = {n: get(n) for n in names}
    bad = [n for n, v in fields.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    q_rank = get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank < 0:
        bad.append("q_lora_rank")
    if bad:
        raise SeqparInputError(f"MLA attention needs positive integer {', '.join(bad)} (q_lora_rank may be None)")
    return {**fields, "q_lora_rank": q_rank}
