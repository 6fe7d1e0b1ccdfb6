"""A plan as text (the ranked table and the rejected families) and as JSON.

Used by ``seqpar plan`` and ``seqpar train --plan``.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from seqpar.planning.search import Candidate, Plan


def _features(c: Candidate) -> str:
    return "+".join(c.layout.features) or "none"


def _pipeline(c: Candidate) -> str:
    """ "1", or the pp degree with the micro-batches and the bubble's share of the step (Note [plan time model])."""
    lay = c.layout
    if lay.pp == 1:
        return "1"
    return f"{lay.pp} (m {lay.pp_microbatches}, {c.time.bubble / c.time.total:.0%})"


def _kind(reason: str) -> str:
    """A rejection reason without its numbers."""
    return "".join(ch for ch in reason.split(":")[0] if not ch.isdigit())


def format_plan(result: Plan, top: int = 10, rejected: int = 15) -> str:
    """The plan as a Markdown table of the ``top`` best layouts, then the rejected families.

    Args:
        result: what ``plan`` returned.
        top: rows of the table.
        rejected: rejected families listed (the rest are counted; ``plan_to_dict`` has them all).

    Returns:
        The text to print.
    """
    m, c = result.model, result.cluster
    lines = [
        f"{m.num_hidden_layers} layers x {m.hidden_size} hidden, {m.num_attention_heads}/{m.num_key_value_heads} "
        f"heads, vocab {m.vocab_size} ({_parameters(m)}); seq {result.seq_len:,} x "
        f"micro-batch {result.micro_batch}, {result.dtype}"
        + (f", packed documents of {result.doc_len:,} tokens (placed)" if result.doc_len else ""),
        f"{c.gpus} devices ({c.gpus_per_node} per node), {c.gpu_memory_gb:g} GiB x {c.memory_headroom:g} usable, "
        f"{c.gpu_tflops:g} TFLOP/s (matmul x {c.matmul_efficiency:g}, attention x {c.attention_efficiency:g}), "
        f"links {c.intra_node_gbps:g} GB/s intra, {c.inter_node_gbps:g} Gbit/s inter (x {c.link_efficiency:g}), "
        f"host {c.host_link_gbps:g} GB/s, host AdamW {c.host_adam_gparams_per_s:g}e9 parameters/s per node",
        f"{result.considered} layouts estimated, {len(result.candidates)} fit",
        "",
        "| # | dp | sp | ulysses | tp | pp (bubble) | strategy | dp mode | features | peak/rank (GiB) | step (s) "
        "| tokens/s/GPU | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, cand in enumerate(result.top(top), 1):
        lay = cand.layout
        lines.append(
            f"| {i} | {lay.dp} | {lay.sp} | {lay.ulysses} | {lay.tp} | {_pipeline(cand)} | {lay.strategy} | "
            f"{lay.dp_mode} | "
            f"{_features(cand)} | {cand.peak_bytes / 2**30:.1f} | {cand.time.total:.3g} | "
            f"{cand.tokens_per_s_per_gpu:,.0f} | {cand.mfu:.1%} |"
        )
    if not result.candidates:
        lines.append("| - | nothing fits | | | | | | | | | | | |")
    if result.rejected:
        lines += ["", "Rejected:"]
        # one of each kind of reason first, so a short list still shows every kind
        kinds: dict[str, int] = {}
        for i, r in enumerate(result.rejected):
            kinds.setdefault(_kind(r.reason), i)
        first = sorted(kinds.values())
        order = first + [i for i in range(len(result.rejected)) if i not in set(first)]
        lines += [f"- {result.rejected[i].family}: {result.rejected[i].reason}" for i in order[:rejected]]
        if len(result.rejected) > rejected:
            lines.append(f"- ... {len(result.rejected) - rejected} more (all of them in --json)")
    return "\n".join(lines)


def _candidate(c: Candidate) -> dict:
    return {
        **asdict(c.layout),
        "features": list(c.layout.features),
        "peak_bytes": c.peak_bytes,
        "host_bytes": c.memory.host,
        "step_s": c.time.total,
        "step_parts_s": asdict(c.time),
        "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu,
        "mfu": c.mfu,
    }


def plan_to_dict(result: Plan, top: int = 10) -> dict:
    """The plan as JSON-ready data: inputs, the ``top`` best layouts, every fitting layout, rejections.

    Args:
        result: what ``plan`` returned.
        top: how many layouts go in "top".

    Returns:
        A dictionary of plain values.
    """
    return {
        "model": result.model.as_config(),
        "seq_len": result.seq_len,
        "micro_batch": result.micro_batch,
        "dtype": result.dtype,
        "doc_len": result.doc_len,
        "cluster": asdict(result.cluster),
        "considered": result.considered,
        "top": [_candidate(c) for c in result.top(top)],
        "fitting": len(result.candidates),
        "rejected": [asdict(r) for r in result.rejected],
    }


def write_json(result: Plan, path: str, top: int = 10) -> None:
    """Write ``plan_to_dict(result, top)`` to ``path``.

    Args:
        result: what ``plan`` returned.
        path: the file.
        top: how many layouts go in "top".
    """
    with open(path, "w") as f:
        json.dump(plan_to_dict(result, top), f, indent=2)
        f.write("\n")


def _parameters(m) -> str:
    """Stored parameters, and the active ones for a mixture-of-experts model."""
    stored = f"{m.num_params / 1e9:.2f}B parameters"
    if not m.num_experts:
        return stored
    return f"{stored}, {m.active_params / 1e9:.2f}B active: {m.num_experts_per_tok} of {m.num_experts} experts"
