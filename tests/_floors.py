"""Parameters after several optimizer steps, judged against a float64 run at a floor measured entry by entry.

Note [AdamW floors]
~~~~~~~~~~~~~~~~~~~
After a few AdamW steps two fp32 runs that sum in different orders (one process and seqpar, or one CPU's BLAS and
another's) do not agree to a fixed tolerance. Adam divides each entry's step by the root of its second moment, so
an entry whose gradient is near zero (a key bias that softmax ignores, a weight row few tokens reach, an entry
whose gradients cancel over the steps) turns the rounding of its gradient into a step of up to lr either way. How
far a given order lands is an accident of that order: a floor taken from one or two fp32 runs' distance to
another (or to float64) measures the machine, and the same check fails on a CPU that sums otherwise (issue 57:
4 x a floor of 2.6e-6 measured, 1.14e-5 found on another machine).

So the checks here compare with a float64 run of the same model and the same steps, and measure the floor in
two parts that do not depend on one order's luck:

- the gradients' rounding, per tensor and step: the largest distance of any fp32 run's gradient (one process,
  and others that sum in other orders: another attention kernel, the batch's rows apart) from the float64 run's.
  That is a tensor's worst entry, a stable statistic (the one-step gradient checks compare it too), floored at one
  ulp of the tensor's largest entry;
- how far AdamW carries it, entry by entry: the float64 steps replayed from the same start with every gradient
  entry moved by that amount, in each of the 2^steps sign patterns (AdamW works on every entry alone, and one of
  the patterns is each entry's worst, exactly so where the steps are linear in the gradient); plus the fp32
  arithmetic of the steps themselves, ``ARITHMETIC_ULPS`` ulps of the parameter and of lr a step.

A run passes when each entry is within ``FLOOR_FACTOR`` times its own floor of the float64 run. The factor is the
usual "4x the noise": seqpar's gradients are within 4 times one process's distance from float64 (the one-step
checks), and Adam's step grows at most about linearly with its gradient's error (normalised, it saturates near
lr), so 4 times the rounding moves an entry about 4 times as far at most. Measured, seqpar sits at up to 1.8 times
its floor (a Zamba2 convolution bias; below 1.5 elsewhere). The bound is tight where a gradient is well above its
rounding (about lr x rounding / gradient) and up to a few lr where it is not, so a missing exchange, which moves
every gradient by far more than rounding, still fails it (the mixers' embeddings 2e-3 from float64 against floors
of 1e-8); the one-step gradient checks stay the tight ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["ARITHMETIC_ULPS", "FLOOR_FACTOR", "StepFloors", "assert_near_float64", "gradients"]

FLOOR_FACTOR = 4.0
"""How far past its floor (Note [AdamW floors]) an entry may be: seqpar's gradient rounding is up to about 4 times
one process's, and Adam's step grows no faster than about linearly with the gradient's error."""
ARITHMETIC_ULPS = 4.0
"""The fp32 arithmetic of one optimizer step, in ulps of the parameter and of lr: storing the parameter rounds it
(half an ulp), and AdamW's moments, square root and division round its step by a few."""
_ULP = 2.0**-24  # fp32's unit roundoff


Gradients = torch.nn.Module | Sequence[torch.Tensor | None]


def gradients(run: Gradients) -> list[torch.Tensor | None]:
    """A model's parameters' gradients in order (copies; None where a parameter has none), or ``run`` itself."""
    if isinstance(run, torch.nn.Module):
        return [None if p.grad is None else p.grad.detach().clone() for p in run.parameters()]
    return list(run)


def _zero_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return g if g is not None else torch.zeros_like(like)


def _replayed(g: torch.Tensor | None, sign: int, rounding: float) -> torch.Tensor | None:
    # no gradient (frozen, or no token reached it): the optimizer skips the tensor, as in the float64 run
    return None if g is None else g + sign * rounding


class StepFloors:
    """Each parameter entry's rounding floor after the steps of a float64 run (Note [AdamW floors]).

    ``optimizer`` builds the runs' optimizer on a list of tensors (the same settings as every run's). Call
    ``record`` at every step after the gradients are final (summed, clipped) and before the optimizers step, then
    ``floors()`` once.
    """

    def __init__(self, exact: torch.nn.Module, optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.optimizer = optimizer
        self.start = [p.detach().clone() for p in exact.parameters()]
        assert all(p.dtype == torch.float64 for p in self.start), "the exact run is float64"
        self.grads: list[list[torch.Tensor | None]] = []
        self.rounding: list[list[float]] = []

    def record(self, exact: Gradients, runs: Iterable[Gradients]) -> None:
        """The float64 gradients of this step, and per tensor the fp32 ``runs``' largest distance from them (each a
        model, or its parameters' gradients in order: ``gradients(model)`` taken before its optimizer stepped)."""
        want, others = gradients(exact), [gradients(run) for run in runs]
        rounding = []
        for i, g in enumerate(want):
            g = g if g is not None else torch.zeros_like(self.start[i])
            own = max(float((_zero_if_none(run[i], g).double() - g).abs().max()) for run in others)
            rounding.append(max(own, 2 * _ULP * float(g.abs().max())))
        self.grads.append(want)
        self.rounding.append(rounding)

    def _replay(self, signs: Sequence[int]) -> list[torch.Tensor]:
        params = [p.clone() for p in self.start]
        opt = self.optimizer(params)
        for grads, rounding, sign in zip(self.grads, self.rounding, signs, strict=True):
            for p, g, r in zip(params, grads, rounding, strict=True):
                p.grad = _replayed(g, sign, r)
            opt.step()
        return [p.detach() for p in params]

    def floors(self) -> list[torch.Tensor]:
        """Per parameter, each entry's floor: the farthest the replayed steps land from the float64 run's over the
        sign patterns, plus the steps' fp32 arithmetic."""
        steps = len(self.grads)
        center = self._replay([0] * steps)
        worst = [torch.zeros_like(p) for p in center]
        for signs in itertools.product((-1, 1), repeat=steps):
            for w, p, c in zip(worst, self._replay(signs), center, strict=True):
                torch.maximum(w, (p - c).abs(), out=w)
        lr = float(self.optimizer([torch.zeros(1, dtype=torch.float64)]).param_groups[0]["lr"])
        return [w + steps * ARITHMETIC_ULPS * _ULP * (c.abs() + lr) for w, c in zip(worst, center, strict=True)]


def assert_near_float64(
    found: Iterable[tuple[str, torch.Tensor]],
    exact: torch.nn.Module,
    floors: Sequence[torch.Tensor],
    what: str,
    factor: float = FLOOR_FACTOR,
) -> float:
    """Every entry of the named parameters ``found`` within ``factor`` times its floor of the float64 ``exact``
    model's; returns the least margin (bound over distance) of the entries that differ at all."""
    margin = math.inf
    for (name, p), q, floor in zip(found, exact.parameters(), floors, strict=True):
        gap, bound = (p.detach().double() - q.detach()).abs(), factor * floor
        past = gap > bound
        if past.any():
            i = int(torch.where(past, gap / bound, 0).argmax())
            raise AssertionError(
                f"{what} {name}: {int(past.sum())} of {gap.numel()} entries past {factor:g} x their floor from "
                f"float64; the worst (entry {i}) {gap.flatten()[i]:.2e}, floor {floor.flatten()[i]:.2e}"
            )
        moved = gap > 0
        if moved.any():
            margin = min(margin, float((bound[moved] / gap[moved]).min()))
    return margin
