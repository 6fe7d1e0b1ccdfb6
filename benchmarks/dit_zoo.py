"""``python -m benchmarks.dit_zoo``: every transformer class of the installed diffusers, built tiny, run on one process
and through ``seqpar.prepare_diffusers`` under sequence parallelism, and classified as the language zoo is (issue 60).

Run::

    python -m benchmarks.dit_zoo                        # every class at sp 2 (ring) -> benchmarks/dit_zoo_cpu.json
    python -m benchmarks.dit_zoo --only WanTransformer3DModel --sp 3 --strategy ulysses --out /tmp/dit.json

One pool of gloo ranks serves every class. On every rank a class's tiny model and batch (``tests._dit_zoo``) give
the reference: one process's prediction and the gradients of a fixed weighted sum of it (float32, and a float64
copy for the floors where the model runs in float64). The run under test is the same model through
``seqpar.prepare_diffusers`` with the whole batch on every rank, the same loss, and ``seqpar.reduce_gradients``.
The prediction and every parameter's gradient are judged as ``benchmarks.zoo`` judges logits (``RTOL`` of the
float64 scale, or ``FLOOR_FACTOR`` x the fp32 run's distance from float64). Statuses are those of
``benchmarks.zoo``: EXACT, WRONG, REFUSED (seqpar's ``SeqparInputError``), CRASH, HANG, BUILD, SET ASIDE.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import torch

from benchmarks import ROOT, save_records
from benchmarks.zoo import (
    BOTH,
    BUILD,
    CRASH,
    EXACT,
    REFUSED,
    SET_ASIDE,
    STATUSES,
    WRONG,
    copied_gradients,
    first_line,
    judge,
    last_line,
    module_floors,
    pool_outcome,
)

RECORD = ROOT / "benchmarks" / "dit_zoo_cpu.json"


def _as(value: object, dtype: torch.dtype) -> object:
    """``value`` with its floating tensors (nested in lists, tuples and dicts too) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_as(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _as(v, dtype) for k, v in value.items()}
    return value


def _prediction(output: object) -> torch.Tensor:
    """The prediction as one tensor (models that return one tensor per sample give a list: flattened, joined)."""
    if isinstance(output, (list, tuple)):
        return torch.cat([t.reshape(-1) for t in output])
    return output


def _run(model: torch.nn.Module, inputs: dict, output: int, weight_seed: int) -> tuple[torch.Tensor, dict]:
    """The prediction and every parameter's gradient of ``sum(prediction x w)`` (``w`` fixed by ``weight_seed``)."""
    model.zero_grad(set_to_none=True)
    pred = _prediction(model(**inputs, return_dict=False)[output])
    weight = torch.randn(pred.shape, generator=torch.Generator().manual_seed(weight_seed), dtype=torch.float64)
    (pred * weight.to(pred.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return pred.detach(), grads


def _class_on_rank(rank: int, world_size: int, name: str, strategy: str, control: bool | str, out_dir: str) -> None:
    """Judge one class on this rank and write the outcome to ``out_dir/rank<r>.json`` (never raise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome = judge_class(world_size, name, strategy, control)
        except Exception as error:  # a failure of the harness itself, reported rather than hung
            outcome = {"status": CRASH, "reason": f"harness: {last_line(error)}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def judge_class(world_size: int, name: str, strategy: str, control: bool | str) -> dict[str, Any]:
    """``control``: True leaves the gradients unreduced (the negative control); ``BOTH`` reduces them and judges
    them as they were before the reduction too, as ``outcome["control"]``."""
    import seqpar
    from seqpar.errors import SeqparInputError
    from seqpar.models import DIFFUSION_PLANS
    from tests._dit_zoo import ZOO, build

    try:
        model, inputs = build(name)
        pristine = copy.deepcopy(model)
        want, want_grads = _run(model, inputs, ZOO[name].output, 3)
    except Exception as error:
        return {"status": BUILD, "reason": f"one process cannot run it: {last_line(error)}"}
    try:
        exact, exact_grads = _run(copy.deepcopy(pristine).double(), _as(inputs, torch.float64), ZOO[name].output, 3)
    except Exception:  # a model that takes no float64 (a dtype it hard-codes): RTOL alone
        exact, exact_grads = None, {}
    mesh = seqpar.make_mesh(sp_size=world_size)
    try:
        parallel = seqpar.prepare_diffusers(pristine, mesh, strategy=strategy)
        parallel.zero_grad(set_to_none=True)
        pred = _prediction(parallel(**inputs, return_dict=False)[ZOO[name].output])
        weight = torch.randn(pred.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (pred * weight.to(pred.dtype)).sum().backward()
        # the negative control's gradients: each rank's own tokens', as they are before the reduction
        unreduced = copied_gradients(parallel) if control == BOTH else None
        if control in (False, BOTH):  # the negative control alone leaves them unreduced
            seqpar.reduce_gradients(parallel.parameters(), mesh)
    except SeqparInputError as error:
        return {"status": REFUSED, "reason": first_line(error)}
    except Exception as error:
        return {"status": CRASH, "reason": last_line(error), "trace": traceback.format_exc()[-2000:]}
    plan = "derived" if DIFFUSION_PLANS.get(name) is None else "entry"
    outcome = _verdict(parallel, pred, want, exact, want_grads, exact_grads) | {"plan": plan}
    if unreduced is not None:
        outcome["control"] = _verdict(parallel, pred, want, exact, want_grads, exact_grads, unreduced)
    return outcome


def _verdict(
    parallel: torch.nn.Module,
    pred: torch.Tensor,
    want: torch.Tensor,
    exact: torch.Tensor | None,
    want_grads: dict,
    exact_grads: dict,
    grads: dict | None = None,
) -> dict[str, Any]:
    """EXACT or WRONG, with the worst tensor: the prediction and every parameter's gradient (``grads`` by name,
    default the parameters' own) against the one-process run and the float64 run; a gradient zero in exact arithmetic
    is judged against its module's floor (``benchmarks.zoo.module_floors``: one rule for both zoos)."""
    judged = [judge("prediction", pred, want, exact)]
    floors = module_floors(want_grads, exact_grads)
    for param_name, p in parallel.named_parameters():
        got, one = p.grad if grads is None else grads[param_name], want_grads.get(param_name)
        if got is None and one is None:
            continue
        zero = torch.zeros_like(p.detach())
        judged.append(
            judge(
                f"grad {param_name}",
                zero if got is None else got,
                zero if one is None else one,
                exact_grads.get(param_name),
                floors.get(param_name.rpartition(".")[0], (0.0, 0.0)),
            )
        )
    worst = max(judged, key=lambda j: j[0])
    return {"status": WRONG if worst[0] > 1.0 else EXACT, "worst": worst[1], "worst_ratio": worst[0]}


def sweep(
    sp_size: int,
    only: list[str] | None = None,
    strategy: str = "ring",
    deadline_s: float = 120.0,
    control: bool = False,
    controls: Collection[str] = (),
    pool: Any = None,
) -> dict[str, dict[str, Any]]:
    """Judge every class of the installed diffusers (or ``only`` those) at ``sp_size``: class name -> its outcome.

    ``control`` is the negative control: the gradients are left unreduced, so every class that runs comes out WRONG.
    ``controls``: classes whose outcome also holds that control, judged from the same run (``BOTH``) under
    "control". ``pool``: a ``RankPool`` of ``sp_size`` ranks to run on, left open (default: one of its own).
    """
    from tests._dit_zoo import SET_ASIDE as ASIDE
    from tests._dit_zoo import ZOO
    from tests._pool import RankPool

    names = sorted({*ZOO, *ASIDE})
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"not in the DiT zoo: {', '.join(unknown)}")
        names = [n for n in names if n in only]
    results: dict[str, dict[str, Any]] = {}
    own = pool is None
    pool = RankPool(sp_size, timeout=timedelta(seconds=deadline_s / 2)) if own else pool
    if pool.world_size != sp_size:
        raise ValueError(f"a pool of {pool.world_size} ranks for a sweep at sp {sp_size}")
    try:
        for name in names:
            if name in ASIDE:
                results[name] = {"status": SET_ASIDE, "reason": ASIDE[name]}
                continue
            started = time.perf_counter()
            judged = BOTH if name in controls and not control else control
            outcome = pool_outcome(pool, _class_on_rank, name, strategy, judged, deadline_s=deadline_s)
            results[name] = outcome | {"seconds": round(time.perf_counter() - started, 2)}
            said = outcome.get("worst") if outcome["status"] in (EXACT, WRONG) else outcome.get("reason", "")
            print(f"{name:42s} {outcome['status']:8s} {results[name]['seconds']:6.1f}s  {said[:110]}")
    finally:
        if own:
            pool.close(kill=True)
    return results


def totals(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    found = Counter(r["status"] for r in results.values())
    return {s: found[s] for s in STATUSES}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel degree (ranks in the pool)")
    parser.add_argument("--strategy", default="ring", help="seqpar.attention's strategy")
    parser.add_argument("--only", default="", help="comma-separated class names (default: every class)")
    parser.add_argument("--control", action="store_true", help="negative control: gradients left unreduced")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds one class may take before HANG")
    parser.add_argument("--out", default=str(RECORD), help="the JSON record")
    args = parser.parse_args(argv)
    import diffusers

    started = time.perf_counter()
    only = [m for m in args.only.split(",") if m] or None
    results = sweep(args.sp, only, args.strategy, args.deadline, args.control)
    wall = time.perf_counter() - started
    counts = totals(results)
    print("\n" + "".join(f"{s:>10s}" for s in STATUSES))
    print("".join(f"{counts[s]:10d}" for s in STATUSES))
    print(f"\n{len(results)} classes at sp {args.sp} in {wall:.0f} s (diffusers {diffusers.__version__})")
    record = {
        "diffusers": diffusers.__version__,
        "torch": torch.__version__,
        "sp": args.sp,
        "strategy": args.strategy,
        "wall_s": round(wall, 1),
        "totals": counts,
        "models": results,
    }
    save_records(args.out, "dit_zoo", argv, [record])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
