"""``python -m benchmarks.zoo``: every causal-LM and image-text-to-text family of the installed transformers, built
tiny, run on one process and under sequence parallelism through seqpar's own-loop door, and classified (issue 58).

Run::

    python -m benchmarks.zoo                              # every family at sp 2 -> benchmarks/zoo_cpu.json
    python -m benchmarks.zoo --only llama,gemma3 --sp 3   # a subset at sp 3
    python -m benchmarks.zoo --packed --out /tmp/zoo_packed.json  # a row of two documents vs each alone

One pool of gloo ranks (one thread each) serves every family. On every rank a family's tiny model
(``seqpar.models.zoo.tiny_config``; image-text-to-text models run their text path, no images) takes a batch of
2 random rows: the reference is the whole batch on one process (float32, and a float64 copy for the floors, float64
throughout: ``WideFloats``; rank 0 runs the one, rank 1 the other, each sending its result to every rank:
``split_references``), the run under test
is ``seqpar.prepare_model`` on the rank's zigzag shard with ``seqpar.cross_entropy`` and
``seqpar.reduce_gradients``. The loss, the shard's logits and every parameter's summed gradient are compared with
the reference's, each tensor within ``max(RTOL x its float64 scale, FLOOR_FACTOR x |fp32 - float64|)`` (a
gradient at fp32's rounding floor is judged against the floor, Note [AdamW floors] in tests/_floors.py).

Each family ends as one of:

- EXACT: every tensor within its bound;
- WRONG: some tensor past its bound (the worst is named);
- REFUSED: seqpar raised ``SeqparInputError`` (its message);
- CRASH: any other exception under seqpar (its last line);
- HANG: the ranks did not finish within the family's deadline (the pool is restarted);
- BUILD: the tiny model cannot be built or cannot run its text path on one process (the reason);
- SET ASIDE: not a decoder-only language model (encoder-decoders, encoders used as decoders).

Each rank writes its own outcome to a file and returns normally, so a refusal or a crash on one rank never
hangs the pool's closing barrier; the parent merges the ranks' files.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from benchmarks import ROOT, save_records

EXACT, WRONG, REFUSED, CRASH, HANG, BUILD = "EXACT", "WRONG", "REFUSED", "CRASH", "HANG", "BUILD"
SET_ASIDE = "SET ASIDE"
STATUSES = (EXACT, REFUSED, WRONG, CRASH, HANG, BUILD, SET_ASIDE)
BOTH = "both"
"""``control=BOTH``: the run judged as usual, and its gradients before the reduction judged as the negative control
(under the outcome's "control"), from the one backward pass."""
ROWS = 2
RTOL = 1e-4
FLOOR_FACTOR = 4.0
"""How far past the fp32 run's own distance from float64 seqpar may be (tests/_floors.py's factor)."""


def _documents(seq: int) -> tuple[int, ...]:
    """Two documents in one row, the edge inside a shard at sp 2 and 3 (10 of 24 tokens)."""
    return (seq * 5 // 12, seq - seq * 5 // 12)


def _seq_len(sp_size: int) -> int:
    """Row length: 24 tokens at sp 2 (as issue 58 asks), else the least multiple of 24 that zigzag cuts evenly."""
    return 24 if 24 % (2 * sp_size) == 0 else 24 * (2 * sp_size) // math.gcd(24, 2 * sp_size)


def last_line(error: BaseException) -> str:
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else type(error).__name__


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:400] if str(error).strip() else type(error).__name__


def _reference(
    model: torch.nn.Module, ids: torch.Tensor, documents: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the whole batch: logits, the token-mean loss of next-token prediction, and the gradients.

    ``documents``: the lengths of the documents packed in each row, each run by itself (None: whole rows).
    """
    model.zero_grad(set_to_none=True)
    pieces = [(0, ids.shape[1])] if documents is None else list(zip(_starts(documents), documents))
    logits, total, count = [], 0.0, 0
    for start, n in pieces:
        doc = ids[:, start : start + n]
        out = model(input_ids=doc, position_ids=torch.arange(n)[None].expand_as(doc)).logits
        predicted = torch.nn.functional.cross_entropy(
            out[:, :-1].flatten(0, 1).float(), doc[:, 1:].flatten(), reduction="sum"
        )
        logits.append(out.detach())
        total, count = total + predicted, count + doc[:, 1:].numel()
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits, dim=1), loss.detach(), grads


def split_references(
    rank: int, world_size: int, model: torch.nn.Module, fp32_run: Any, fp64_run: Any = None
) -> tuple[torch.nn.Module, tuple | str, tuple]:
    """The one-process references of ``model``, each computed once in the group and sent to every rank.

    Rank 0 runs ``fp32_run(model)``, rank 1 ``fp64_run`` (by default ``fp32_run``) on the model in float64, with
    float64 the default dtype so that what the forward makes is float64 too. Returns, on every rank, a copy of
    the model taken before any forward (a model may keep non-leaf tensors: Recurrent Gemma) for the run under
    test, the float32 reference (or the last line of its error: the family cannot run on one process) and the
    float64 reference (``(None, None, {})`` where the model takes no float64: judged at RTOL alone).
    """
    import torch.distributed as dist

    pristine = copy.deepcopy(model) if rank < 2 else model
    with torch.random.fork_rng(devices=[]):  # every rank leaves with the random state it came with
        want, exact = _own_references(rank, world_size, model, pristine, fp32_run, fp64_run)
    sent = [[want], [exact]]
    dist.broadcast_object_list(sent[0], src=0)
    dist.broadcast_object_list(sent[1], src=min(1, world_size - 1))
    return pristine, sent[0][0], sent[1][0]


def _own_references(
    rank: int, world_size: int, model: torch.nn.Module, pristine: torch.nn.Module, fp32_run: Any, fp64_run: Any
) -> tuple[tuple | str, tuple]:
    """This rank's part of ``split_references``: the float32 run on rank 0, the float64 one on rank 1 (both on
    rank 0 when it is alone)."""
    want: tuple | str = ""
    exact: tuple = (None, None, {})
    if rank == 0:
        try:
            want = fp32_run(model)
        except Exception as error:
            want = last_line(error)
    if rank == min(1, world_size - 1):
        default = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            wide = model.double() if rank == 1 else copy.deepcopy(pristine).double()
            if getattr(wide.config, "_experts_implementation", None) not in (None, "eager"):
                wide.set_experts_implementation("eager")  # a grouped matmul takes no float64; the loop does
            with WideFloats():
                exact = (fp64_run or fp32_run)(wide)
        except Exception:  # a model that takes no float64 (a kernel, a dtype it hard-codes): RTOL alone
            exact = (None, None, {})
        finally:
            torch.set_default_dtype(default)
    return want, exact


class WideFloats(TorchFunctionMode):
    """The float64 reference in float64 throughout: where a model's own code asks for float32 (an upcast before a
    norm, a kernel that computes in float32 whatever it is given: transformers' gated delta rule), it gets float64,
    so the reference's distance from the fp32 run is fp32's rounding, not a share of it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        wide = lambda a: torch.float64 if a is torch.float32 else a  # noqa: E731
        func = torch.Tensor.double if func is torch.Tensor.float else func
        return func(*map(wide, args), **{k: wide(v) for k, v in (kwargs or {}).items()})


def _starts(documents: tuple[int, ...]) -> list[int]:
    return [sum(documents[:i]) for i in range(len(documents))]


def module_floors(fp32: dict[str, torch.Tensor], fp64: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per module (a parameter name without its last part), the largest fp32 floor and the largest float64 scale
    among its parameters' gradients.

    A gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores a shift shared by every
    key) is rounding noise in both runs, and one run's noise is no robust measure of another's; its module's
    other gradients, summed over the same tokens, give the floor it is judged by. Likewise a parameter of one
    element (a gate's scale, a temperature) scales everything its module computes, on every token: its gradient
    is a sum over all of them that may cancel far below its terms (HY-V4-VL's hyper-connection head), so its
    own magnitude is no measure of its rounding, and its module's largest gradient is the scale it is judged at.
    """
    floors: dict[str, tuple[float, float]] = {}
    for name, want in fp32.items():
        if name in fp64 and want.numel():
            module = name.rpartition(".")[0]
            exact = fp64[name].double()
            floor, scale = float((want.double() - exact).abs().max()), float(exact.abs().max())
            known = floors.get(module, (0.0, 0.0))
            floors[module] = (max(known[0], floor), max(known[1], scale))
    return floors


def judge(
    name: str,
    got: torch.Tensor,
    fp32: torch.Tensor,
    fp64: torch.Tensor | None,
    module: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, str] | None:
    """(distance over bound, description) of ``got`` against the references; None when both are exact zeros.

    ``module``: the floor and scale of the tensor's module (``module_floors``): its floor bounds a tensor that is
    zero to fp32's precision (its float64 scale no larger than its own floor), its scale a one-element tensor.
    """
    got, fp32 = got.detach().double(), fp32.detach().double()
    gap = float((got - fp32).abs().max()) if got.numel() else 0.0
    if fp64 is None:  # no float64 run: judge against the fp32 reference at RTOL of its own scale
        scale, floor = float(fp32.abs().max()) if fp32.numel() else 0.0, 0.0
    else:
        fp64 = fp64.detach().double()
        scale = float(fp64.abs().max()) if fp64.numel() else 0.0
        floor = float((fp32 - fp64).abs().max()) if fp64.numel() else 0.0
        floor = max(floor, module[0]) if scale <= floor else floor  # noise in both runs: its module's floor
        scale = max(scale, module[1]) if fp64.numel() == 1 else scale  # a sum that may cancel: its module's scale
    bound = max(RTOL * scale, FLOOR_FACTOR * floor)
    if gap == 0.0:
        return 0.0, name
    ratio = math.inf if bound == 0.0 else gap / bound
    return ratio, f"{name}: {gap:.2e} from one process, bound {bound:.2e} (scale {scale:.2e}, fp32 floor {floor:.2e})"


def _family_on_rank(
    rank: int,
    world_size: int,
    model_type: str,
    mappings: tuple[str, ...],
    packed: bool,
    control: bool | str,
    out_dir: str,
) -> None:
    """Judge one family on this rank and write the outcome to ``out_dir/rank<r>.json`` (never raise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome = _judge_family(rank, world_size, model_type, mappings, packed, control)
        except Exception as error:  # a failure of the harness itself, reported rather than hung
            outcome = {"status": CRASH, "reason": f"harness: {last_line(error)}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _judge_family(
    rank: int, world_size: int, model_type: str, mappings: tuple[str, ...], packed: bool, control: bool | str
) -> dict[str, Any]:
    import transformers

    from seqpar.models.zoo import TEXT_IDS, tiny_model

    transformers.logging.set_verbosity_error()
    model = tiny_model(model_type, mappings)
    if isinstance(model, str):
        return {"status": BUILD, "reason": model}
    seq = _seq_len(world_size)
    documents = _documents(seq) if packed else None
    ids = torch.randint(*TEXT_IDS, (1 if packed else ROWS, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids}
    if documents is not None:  # positions restart at each document: seqpar keeps them apart
        batch["position_ids"] = torch.cat([torch.arange(n) for n in documents])[None]
    started = time.perf_counter()
    pristine, want, exact = split_references(rank, world_size, model, lambda m: _reference(m, ids, documents))
    if isinstance(want, str):
        return {"status": BUILD, "reason": f"one process cannot run its text path: {want}"}
    reference_s = time.perf_counter() - started

    def on_shards(model: torch.nn.Module, shard: dict) -> torch.Tensor:
        return model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits

    outcome = judged_run(pristine, rank, world_size, batch, on_shards, want, exact, control)
    outcome["reference_s"] = round(reference_s, 3)
    return outcome


def judged_run(
    pristine: torch.nn.Module,
    rank: int,
    world_size: int,
    batch: dict,
    call: Any,
    want: tuple,
    exact: tuple,
    control: bool | str,
    strategy: str = "auto",
) -> dict[str, Any]:
    """The prepared ``pristine`` run on this rank and judged (``verdict``), or REFUSED / CRASH with the reason.

    ``call(model, shard)`` gives the logits of this rank's tokens (on the shard of ``batch``, or on whole rows);
    the loss is ``seqpar.cross_entropy`` on the shard's labels. ``control`` leaves the gradients unreduced;
    ``BOTH`` reduces them and judges this rank's gradients before the reduction too, as ``outcome["control"]``.
    """
    import seqpar
    from seqpar.errors import SeqparInputError
    from tests._dist import shard_index

    mesh = seqpar.make_mesh(sp_size=world_size)
    try:
        parallel = seqpar.prepare_model(pristine, mesh, strategy=strategy)
        parallel.zero_grad(set_to_none=True)
        shard = seqpar.shard_batch(batch, mesh)
        logits = call(parallel, shard)
        loss = seqpar.cross_entropy(logits.float(), shard["shift_labels"], mesh)
        loss.backward()
        # the negative control's gradients: each rank's own shard's, as they are before the reduction
        unreduced = copied_gradients(parallel) if control == BOTH else None
        if control in (False, BOTH):  # the negative control alone leaves them unreduced
            seqpar.reduce_gradients(parallel.parameters(), mesh)
        total = seqpar.sum_over(loss.detach(), mesh)
    except SeqparInputError as error:
        return {"status": REFUSED, "reason": first_line(error)}
    except Exception as error:
        return {"status": CRASH, "reason": last_line(error), "trace": traceback.format_exc()[-2000:]}
    idx = shard_index("zigzag", world_size, rank, batch["input_ids"].shape[1])
    outcome = verdict(parallel, total, logits, idx, want, exact)
    if unreduced is not None:
        outcome["control"] = verdict(parallel, total, logits, idx, want, exact, unreduced)
    return outcome


def copied_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's gradient (None where it has none)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def verdict(
    parallel: torch.nn.Module,
    total: torch.Tensor,
    logits: torch.Tensor,
    idx: torch.Tensor,
    want: tuple,
    exact: tuple,
    grads: dict[str, torch.Tensor | None] | None = None,
) -> dict[str, Any]:
    """EXACT or WRONG, with the worst tensor: the summed loss, this rank's logits (the reference's columns ``idx``)
    and every parameter's gradient of the prepared model against the one-process run ``want`` and the float64 run
    ``exact`` (each ``(logits, loss, gradients)``; ``(None, None, {})`` where no float64 run could be made).
    ``grads``: the gradients to judge by parameter name (default: the parameters' own)."""
    from seqpar.models import anatomy

    (want_logits, want_loss, want_grads), (exact_logits, exact_loss, exact_grads) = want, exact
    judged = [judge("loss", total, want_loss, exact_loss)]
    judged.append(judge("logits", logits, want_logits[:, idx], None if exact_logits is None else exact_logits[:, idx]))
    floors = module_floors(want_grads, exact_grads)
    for name, p in parallel.named_parameters():
        got, expected = p.grad if grads is None else grads[name], want_grads.get(name)
        if got is None and expected is None:
            continue
        zeros = torch.zeros_like(p.detach())
        got, expected = got if got is not None else zeros, expected if expected is not None else zeros
        module = floors.get(name.rpartition(".")[0], (0.0, 0.0))
        judged.append(judge(f"grad {name}", got, expected, exact_grads.get(name), module))
    worst = max(judged, key=lambda j: j[0])
    status = WRONG if worst[0] > 1.0 else EXACT
    anatomy_of = "read" if anatomy(parallel).family.derived else "entry"
    return {"status": status, "worst": worst[1], "worst_ratio": worst[0], "anatomy": anatomy_of}


_RANK = {EXACT: 0, WRONG: 1, REFUSED: 2, CRASH: 3, BUILD: 4, HANG: 5}


def _merge(outcomes: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The family's outcome from its ranks': the worst status (a rank that wrote nothing hung)."""
    from seqpar.runtime.progress import lost_peer

    if any(o is None for o in outcomes):
        silent = [r for r, o in enumerate(outcomes) if o is None]
        said = [o for o in outcomes if o is not None and o["status"] != EXACT]
        reason = f"ranks {silent} wrote no outcome" + (f"; another said {said[0]['reason']}" if said else "")
        return {"status": HANG, "reason": reason}
    rank = lambda o: _RANK.get(o["status"], _RANK[BUILD])  # noqa: E731 (a sweep's own could-not-judge status)
    worst = max(rank(o) for o in outcomes)
    chosen = [o for o in outcomes if rank(o) == worst]
    # the rank that failed by itself, not one that only lost its peer in a collective
    first = next((o for o in chosen if not lost_peer(o.get("reason", ""))), chosen[0])
    if first["status"] in (EXACT, WRONG):
        first = max(chosen, key=lambda o: o.get("worst_ratio", 0.0))
    merged = {k: v for k, v in first.items() if k not in ("trace", "control")}
    if all("control" in o for o in outcomes):  # the negative control judged with it: merged in the same way
        merged["control"] = _merge([o["control"] for o in outcomes])
    return merged | ({"trace": first["trace"]} if "trace" in first else {})


def _read_outcome(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pool_outcome(pool: Any, fn: Any, *args: object, deadline_s: float) -> dict[str, Any]:
    """One case judged on every rank of ``pool`` by ``fn(rank, world, *args, out_dir)``, which writes each rank's
    outcome to ``out_dir/rank<r>.json``; the merged outcome (HANG for a rank that wrote none)."""
    with tempfile.TemporaryDirectory(prefix="seqpar-zoo-") as out_dir:
        # the pool echoes the ranks' output: kept out of the table. A rank that died or hung tears the pool down
        # (its outcome file missing says so); the next run starts another pool
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.suppress(Exception):
            pool.run(fn, *args, out_dir, deadline=timedelta(seconds=deadline_s))
        outcomes = [_read_outcome(os.path.join(out_dir, f"rank{rank}.json")) for rank in range(pool.world_size)]
    return _merge(outcomes)


def sweep(
    sp_size: int,
    only: list[str] | None = None,
    deadline_s: float = 120.0,
    packed: bool = False,
    control: bool = False,
    controls: Collection[str] = (),
    pool: Any = None,
) -> dict[str, dict[str, Any]]:
    """Judge every family of the installed zoo (or ``only`` those) at ``sp_size``: model type -> its outcome.

    ``control`` is the negative control: the gradients are left unreduced, so every family that runs comes out
    WRONG (a judgement that let it pass would let a missing exchange pass). ``controls``: families whose outcome
    also holds that control, judged from the same run (``BOTH``) under "control". ``pool``: a ``RankPool`` of
    ``sp_size`` ranks to run on, left open (default: one of its own, ranks' collectives timing out at half the
    deadline, closed at the end).
    """
    import transformers

    from seqpar.models.zoo import zoo_model_types
    from tests._pool import RankPool

    transformers.logging.set_verbosity_error()  # default configs warn of their special ids: not the sweep's news
    entries = zoo_model_types()
    if only:
        unknown = sorted(set(only) - set(entries))
        if unknown:
            raise SystemExit(f"not in the zoo: {', '.join(unknown)}")
        entries = {k: v for k, v in entries.items() if k in only}
    results: dict[str, dict[str, Any]] = {}
    own = pool is None
    pool = RankPool(sp_size, timeout=timedelta(seconds=deadline_s / 2)) if own else pool
    if pool.world_size != sp_size:
        raise ValueError(f"a pool of {pool.world_size} ranks for a sweep at sp {sp_size}")
    try:
        for model_type, entry in entries.items():
            row: dict[str, Any] = {"mappings": list(entry.mappings)}
            if entry.set_aside is not None:
                results[model_type] = row | {"status": SET_ASIDE, "reason": entry.set_aside}
                continue
            started = time.perf_counter()
            judged = BOTH if model_type in controls and not control else control
            outcome = pool_outcome(
                pool, _family_on_rank, model_type, entry.mappings, packed, judged, deadline_s=deadline_s
            )
            results[model_type] = row | outcome | {"seconds": round(time.perf_counter() - started, 2)}
            said = outcome.get("worst") if outcome["status"] in (EXACT, WRONG) else outcome.get("reason", "")
            print(f"{model_type:28s} {outcome['status']:8s} {results[model_type]['seconds']:6.1f}s  {said[:110]}")
    finally:
        if own:
            pool.close(kill=True)
    return results


def totals(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    from seqpar.models.zoo import CAUSAL_LM, IMAGE_TEXT_TO_TEXT

    found = {"all": Counter(r["status"] for r in results.values())}
    for mapping in (CAUSAL_LM, IMAGE_TEXT_TO_TEXT):
        found[mapping] = Counter(r["status"] for r in results.values() if mapping in r["mappings"])
    return {k: {s: c[s] for s in STATUSES} for k, c in found.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel degree (ranks in the pool)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: the whole zoo)")
    parser.add_argument(
        "--packed", action="store_true", help="one row of two documents against each document alone, not whole rows"
    )
    parser.add_argument(
        "--control", action="store_true", help="negative control: gradients left unreduced, every family WRONG"
    )
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds one family may take before HANG")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "zoo_cpu.json"), help="the JSON record")
    args = parser.parse_args(argv)
    import transformers

    started = time.perf_counter()
    only = [m for m in args.only.split(",") if m] or None
    results = sweep(args.sp, only, args.deadline, args.packed, args.control)
    wall = time.perf_counter() - started
    counts = totals(results)
    print(f"\n{'':18s}" + "".join(f"{s:>10s}" for s in STATUSES))
    for mapping, row in counts.items():
        print(f"{mapping:18s}" + "".join(f"{row[s]:10d}" for s in STATUSES))
    print(f"\n{len(results)} model types at sp {args.sp} in {wall:.0f} s (transformers {transformers.__version__})")
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "sp": args.sp,
        "seq": _seq_len(args.sp),
        "rows": 1 if args.packed else ROWS,
        "documents": list(_documents(_seq_len(args.sp))) if args.packed else None,
        "wall_s": round(wall, 1),
        "totals": counts,
        "models": results,
    }
    save_records(args.out, "zoo", argv, [record])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
