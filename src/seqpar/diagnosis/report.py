"""What ``seqpar.doctor`` found: per-layer differences from one process, setup pitfalls, and a verdict.

Plain dataclasses and their printed table; nothing here runs a model or talks to other ranks.

Note [doctor tolerances]
    Differences are relative: the largest ``|sequence parallel - one process|`` of a layer's output divided
    by the largest ``|one process|`` of that output, and for gradients the largest difference over the
    layer's parameters divided by their largest one-process gradient. Sharded attention sums the same terms
    in another order (blocks merged by log-sum-exp in float32), so results differ by rounding only. In
    float32 that is ~1e-7 per operation and stays far below 1e-4 through a few layers and a backward; a
    wrong mask, a missing shard edge or a token-mixing module makes differences of order 1e-2..1. bf16 keeps
    8 significant bits (one rounding is up to 2^-9 = 2e-3 of the value): every matmul and norm rounds its
    output once, on both sides, and a gradient sums many such terms, so 5e-2 (about 25 roundings) separates
    rounding from real disagreement, which is of order 1e-1..1 there. fp16 keeps 11 bits: 1e-2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Pitfall:
    """One setup problem that makes a sequence-parallel run differ from one process.

    ``kind`` is one of "packing", "labels", "padding", "dropout", "attention", "token_mixing", "ranks",
    "refused" (and "baseline" for the report's notes); ``module`` names where it is (a module name, a batch
    key or a config field).
    """

    kind: str
    module: str
    problem: str
    fix: str


@dataclass(frozen=True)
class LayerRow:
    """One decoder layer (or the model's output) compared between the sharded run and one process.

    ``activation`` and ``gradient`` are relative differences (Note [doctor tolerances]); ``first_module`` is
    the first submodule, in call order, whose output differs (None when all agree).
    """

    name: str
    activation: float
    gradient: float
    attention_calls: int
    first_module: str | None
    tolerance: float

    @property
    def activation_ok(self) -> bool:
        """The layer's output agrees."""
        return self.activation <= self.tolerance

    @property
    def gradient_ok(self) -> bool:
        """The layer's parameter gradients agree."""
        return self.gradient <= self.tolerance

    @property
    def passes(self) -> bool:
        """Activations and gradients agree."""
        return self.activation_ok and self.gradient_ok


@dataclass
class DoctorReport:
    """The doctor's findings, identical on every rank of the sequence-parallel group.

    ``rows`` holds the decoder layers in order and then the model's output (logits; gradients of the
    parameters outside the layers: embeddings, final norm, head). ``first_failing`` is the first layer whose
    activations differ, else the deepest layer whose gradients differ (a backward problem shows below it
    only), else None. ``cause`` says in one sentence whether the library or the setup makes the difference.
    """

    model: str
    sp_size: int
    strategy: str
    layout: str
    dtype: torch.dtype
    tolerance: float
    rows: list[LayerRow] = field(default_factory=list)
    loss: tuple[float, float] | None = None  # (sequence parallel, one process)
    pitfalls: list[Pitfall] = field(default_factory=list)
    notes: list[Pitfall] = field(default_factory=list)  # about a one-process baseline; they do not fail the verdict
    compared_without: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # what each mixer class ran (Note [mixer implementations])
    first_failing: str | None = None
    cause: str = ""

    @property
    def compared(self) -> bool:
        """The comparison ran (False when seqpar refused the model or the batch)."""
        return bool(self.rows)

    @property
    def agrees(self) -> bool:
        """Every layer, the output and the loss agree with one process."""
        return self.compared and self.first_failing is None and all(r.passes for r in self.rows)

    @property
    def verdict(self) -> bool:
        """The run agrees with one process and no setup pitfall was found (exit code 0 of ``seqpar doctor``)."""
        return self.agrees and not self.pitfalls

    def verdict_line(self) -> str:
        """The one-line verdict printed last."""
        if self.verdict:
            return "VERDICT: OK: the sequence-parallel run agrees with one process at every layer; no pitfalls found"
        if self.agrees:
            return (
                f"VERDICT: SETUP: the sequence-parallel run agrees with one process (seqpar is not the cause), but "
                f"{len(self.pitfalls)} setup pitfall(s) above make real runs differ; fix them"
            )
        if not self.compared:
            return f"VERDICT: SETUP: no comparison ran: {self.cause}"
        return f"VERDICT: DIFFERS from {self.first_failing} on: {self.cause}"

    def table(self) -> str:
        """The report as printed by ``seqpar doctor``: header, one line per layer, loss, pitfalls, verdict."""
        dtype = str(self.dtype).replace("torch.", "")
        lines = [
            f"seqpar doctor: {self.model}, sp {self.sp_size}, strategy {self.strategy}, layout {self.layout}, "
            f"{dtype} (tolerance {self.tolerance:.0e} relative to the largest one-process value)"
        ]
        if self.compared_without:
            lines.append(f"compared without: {', '.join(self.compared_without)} (see the pitfalls)")
        lines += [f"mixer kernel: {line}" for line in self.kernels]
        if self.rows:
            width = max(len(r.name) for r in self.rows)
            lines.append(f"{'layer':<{width}}  activations  gradients  seqpar attention calls")
            for r in self.rows:
                mark = "ok" if r.passes else "DIFFERS" + (f" (first in {r.first_module})" if r.first_module else "")
                calls = str(r.attention_calls) if r.attention_calls >= 0 else "-"
                lines.append(f"{r.name:<{width}}  {r.activation:>11.1e}  {r.gradient:>9.1e}  {calls:>22}  {mark}")
        if self.loss is not None:
            lines.append(f"loss: sequence parallel {self.loss[0]:.6f}, one process {self.loss[1]:.6f}")
        lines.append(f"pitfalls: {len(self.pitfalls) or 'none found'}")
        for p in self.pitfalls:
            lines.append(f"  - [{p.kind}] {p.module}: {p.problem}")
            lines.append(f"    fix: {p.fix}")
        for p in self.notes:
            lines.append(f"note [{p.kind}] {p.module}: {p.problem}")
            lines.append(f"    so: {p.fix}")
        lines.append(self.verdict_line())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
