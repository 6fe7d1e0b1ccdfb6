"""The memory half of ``python -m benchmarks.pipeline``: each rank's memory around a pipeline step, beside the estimate.

What is measured and how is described in ``benchmarks.pipeline``; this module also builds the bench's model.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import transformers

import seqpar
from benchmarks.llama_step import llama_config
from seqpar.memory.estimate import estimate_stage_memory
from seqpar.memory.pipeline import held_logits_bytes, stage_views
from seqpar.runtime.memory import reset_resident_peak, resident_mb

__all__ = ["MEMORY_TOLERANCE", "bench_pipeline", "bench_shard", "memory_rows", "memory_worker"]

_MB = 2**20
MEMORY_TOLERANCE = 0.15
"""A stage's estimated memory counts as right within this fraction of the measured."""


def bench_pipeline(cfg: dict, mesh: seqpar.SequenceParallelMesh, schedule: str) -> seqpar.PipelineParallel:
    """The bench's Llama (seed 0) split over pp 2; the whole model is dropped, the stages keep their parts."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**llama_config(cfg, cfg["seq"])))
    seqpar.prepare_model(model, mesh)
    return seqpar.apply_pipeline_parallel(
        model,
        mesh,
        schedule=schedule,
        microbatches=cfg["microbatches"],
        stages_per_rank=2 if schedule == "interleaved" else 1,
    )


def bench_shard(cfg: dict, mesh: seqpar.SequenceParallelMesh) -> dict:
    """The bench's token batch (seed 1), all micro-batches of one step, sharded for ``mesh``."""
    rows = cfg["rows"] * cfg["microbatches"]
    ids = torch.randint(0, cfg["vocab"], (rows, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    return seqpar.shard_batch({"input_ids": ids}, mesh)


def _held_at_backward(pipe: seqpar.PipelineParallel, before: list[float], seen: list[float]) -> None:
    """Read the resident set whenever the backward of a stage's last decoder layer starts (into ``seen``)."""

    def on_output(_module: torch.nn.Module, _args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(hidden) and hidden.requires_grad:
            hidden.register_hook(lambda _grad: seen.append(resident_mb() - before[0]))

    for stage in pipe.stages:
        stage.model.layers[-1].register_forward_hook(on_output)


def _recv_buffer_bytes(pipe: seqpar.PipelineParallel) -> int:
    """Bytes of the receive buffers torch's stages keep between steps (read from the stage objects)."""
    schedule = pipe._built[1]  # built by the warm-up step
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    buffers = {}
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if torch.is_tensor(buffer):
                    buffers[buffer.data_ptr()] = buffer.numel() * buffer.element_size()
    return sum(buffers.values())


def memory_worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    """One rank of the memory run: each schedule's state, in-flight and growth, written by rank 0 to ``out_path``."""
    mesh = seqpar.make_mesh(pp_size=2)
    shard = bench_shard(cfg, mesh)
    records = []
    for schedule in cfg["schedules"]:
        pipe = bench_pipeline(cfg, mesh, schedule)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        before, seen = [0.0], []
        _held_at_backward(pipe, before, seen)

        def step(pipe: seqpar.PipelineParallel = pipe, opt: torch.optim.Optimizer = opt) -> None:
            pipe.step(shard)
            pipe.reduce_gradients()
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)  # kept between steps, as DDP's and FSDP's buffers are

        step()  # warm-up: gradients, AdamW state, the schedule's receive buffers
        state = sum(t.numel() * t.element_size() for p in pipe.parameters() for t in (p, p.grad))
        state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
        state += _recv_buffer_bytes(pipe)
        seen.clear()
        dist.barrier()
        before[0] = resident_mb()
        reset_resident_peak()
        step()
        growth = resident_mb("VmHWM") - before[0]
        mine = torch.tensor([state / _MB, max(seen, default=0.0), growth], dtype=torch.float64)
        ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, mine)
        records.append(
            {
                "schedule": schedule,
                "ranks": [
                    {"state_mb": float(r[0]), "in_flight_mb": float(r[1]), "growth_mb": float(r[2])} for r in ranks
                ],
            }
        )
        del pipe, opt, step
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)


def _estimates(cfg: dict, schedule: str) -> list[dict]:
    """``estimate_stage_memory`` of the bench's step for the first and the last rank, in MiB."""
    views = stage_views(cfg["layers"], 2, schedule, cfg["microbatches"])
    tokens = cfg["rows"] * cfg["seq"]
    found = estimate_stage_memory(
        llama_config(cfg, cfg["seq"]),
        cfg["seq"],
        seqpar.ParallelDims(pp_size=2),
        micro_batch=cfg["rows"],
        optimizer="adamw",
        keep_gradients=True,
        pp_schedule=schedule,
        pp_microbatches=cfg["microbatches"],
    )
    return [
        {
            "state_mb": e.between_steps / _MB,
            # with gradients kept, both activation moments hold every in-flight activation (Note [memory
            # estimate]); the hook reads the resident set when a layer's backward starts, after the loss's
            # gradients are gone, so the last rank's held logits are what it sees of the logits
            "in_flight_mb": (e.checkpointed_activations + held_logits_bytes(view, tokens, cfg["vocab"], 4)) / _MB,
            "growth_mb": e.step_peak / _MB,
            "peak_mb": e.peak / _MB,
            "moment": e.moment,
        }
        for e, view in zip(found, views)
    ]


def memory_rows(records: list[dict], cfg: dict) -> tuple[list[str], list[dict]]:
    """The memory table's rows and the JSON records: each rank measured beside its estimate."""
    lines, out = [], []
    for record in records:
        for rank, (got, est) in enumerate(zip(record["ranks"], _estimates(cfg, record["schedule"]))):
            got = {**got, "peak_mb": got["state_mb"] + got["growth_mb"]}
            ratios = {
                k: est[k] / got[k] if got[k] else float("nan")
                for k in ("state_mb", "in_flight_mb", "growth_mb", "peak_mb")
            }
            within = all(abs(ratios[k] - 1) <= MEMORY_TOLERANCE for k in ("peak_mb", "growth_mb"))
            where = "first" if rank == 0 else "last"
            lines.append(
                f"| {record['schedule']} | {cfg['microbatches']} | {rank} ({where}) | "
                + " | ".join(f"{got[k]:.0f} / {est[k]:.0f} ({ratios[k]:.2f})" for k in ratios)
                + f" | {est['moment']} | {'yes' if within else 'NO'} |"
            )
            out.append(
                {
                    "schedule": record["schedule"],
                    "microbatches": cfg["microbatches"],
                    "rank": rank,
                    "measured": got,
                    "estimated": est,
                    "estimated_vs_measured": ratios,
                    "memory_within_15pct": within,
                }
            )
    return lines, out
