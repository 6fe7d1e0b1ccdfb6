"""``benchmarks.vision_split``: one Qwen2.5-VL-shaped training step on a long video, the vision split on and off.

Run::

    python -m benchmarks.vision_split                         # sp 2, a 64-frame video, 3 rounds (the two take turns)
    python -m benchmarks.vision_split --frames 128 --json vision_split_cpu.json

Each round times one forward and backward of the whole model on every rank with ``split_vision=True`` and with
``split_vision=False`` (Note [vision split]), alternating so that drift on a shared machine hits both alike, and
reads each rank's vision-tower time from hooks. Reports medians; the ratio is the number to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import save_records

__all__ = ["main", "qwen_vl_model", "video_batch"]


def qwen_vl_model(cfg: dict) -> torch.nn.Module:
    """A Qwen2.5-VL with a vision tower of width ``vision`` and ``vision_depth`` blocks (default 4), a text decoder
    of width ``hidden`` and ``layers`` layers (default 2); seed 0."""
    import transformers

    torch.manual_seed(0)
    vision = dict(
        depth=cfg.get("vision_depth", 4),
        hidden_size=cfg["vision"],
        intermediate_size=2 * cfg["vision"],
        out_hidden_size=cfg["hidden"],
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[cfg.get("vision_depth", 4) - 1],
    )
    text = dict(
        vocab_size=1024,
        hidden_size=cfg["hidden"],
        intermediate_size=2 * cfg["hidden"],
        num_hidden_layers=cfg.get("layers", 2),
        num_attention_heads=cfg["hidden"] // 32,  # head size 32, as the mRoPE sections take
        num_key_value_heads=cfg["hidden"] // 64,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001, vision_start_token_id=1002
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config).float()


def video_batch(cfg: dict) -> dict:
    """One row: 16 text tokens, the video's placeholders, 16 text tokens; random pixels of the video's shape."""
    side = cfg["side"] // 14  # patches along each side
    grid = torch.tensor([[cfg["frames"] // 2, side, side]])
    tokens = int(grid.prod()) // 4
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 1000, (32,), generator=g)
    ids = torch.cat([text[:16], torch.full((tokens,), 1001), text[16:]])[None]
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g)
    types = (ids == 1001).int() * 2
    return {"input_ids": ids, "pixel_values_videos": pixels, "video_grid_thw": grid, "mm_token_type_ids": types}


def _worker(rank: int, world_size: int, cfg: dict, out: str) -> None:
    import seqpar

    mesh = seqpar.make_mesh()
    batch = video_batch(cfg)
    models = {split: seqpar.prepare_model(qwen_vl_model(cfg), mesh, split_vision=split) for split in (True, False)}
    tower_s: dict[bool, list[float]] = {True: [], False: []}
    step_s: dict[bool, list[float]] = {True: [], False: []}
    for split, model in models.items():
        began: list[float] = []
        model.model.visual.register_forward_pre_hook(lambda *_, b=began: b.append(time.perf_counter()))
        model.model.visual.register_forward_hook(
            lambda *_, b=began, s=split: tower_s[s].append(time.perf_counter() - b[-1])
        )
    shard = seqpar.shard_batch({"input_ids": batch["input_ids"]}, mesh)
    for round_ in range(cfg["rounds"] + 1):  # round 0 warms up
        for split, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            logits = model(**batch, seqpar_layout=shard.layout).logits
            seqpar.cross_entropy(logits, shard["shift_labels"], mesh).backward()
            dist.barrier()
            if round_:
                step_s[split].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    towers = [None] * world_size
    mine = {str(s): statistics.median(times[1:]) for s, times in tower_s.items()}  # the warm-up round left out
    dist.all_gather_object(towers, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": {str(s): statistics.median(v) for s, v in step_s.items()}, "tower_s": towers}, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vision_split",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--frames", type=int, default=64, help="video frames (2 a temporal patch)")
    parser.add_argument("--side", type=int, default=112, help="frame height and width in pixels (14-pixel patches)")
    parser.add_argument("--vision", type=int, default=128, help="vision tower width")
    parser.add_argument("--hidden", type=int, default=128, help="text decoder width")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the record here")
    args = parser.parse_args(argv)
    from seqpar.runtime.spawn import spawn_ranks

    cfg = {k: getattr(args, k) for k in ("sp", "frames", "side", "vision", "hidden", "rounds")}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(_worker, args.sp, cfg, out)
        with open(out) as f:
            result = json.load(f)
    on, off = result["step_s"]["True"], result["step_s"]["False"]
    towers_on = [t["True"] for t in result["tower_s"]]
    towers_off = [t["False"] for t in result["tower_s"]]
    tokens = (args.frames // 2) * (args.side // 14) ** 2 // 4
    print(
        f"Qwen2.5-VL-shaped, one {args.frames}-frame {args.side}x{args.side} video ({tokens} video tokens), "
        f"sp {args.sp}"
    )
    print(f"step (fwd+bwd, median of {args.rounds}): split {on:.3f} s, whole {off:.3f} s, ratio {on / off:.2f}")
    print(
        "vision tower forward per rank: split "
        + ", ".join(f"{t:.3f}" for t in towers_on)
        + " s; whole "
        + ", ".join(f"{t:.3f}" for t in towers_off)
        + " s"
    )
    if args.json:
        record = {**cfg, "video_tokens": tokens, "step_split_s": on, "step_whole_s": off, "step_ratio": on / off}
        record.update(tower_split_s=towers_on, tower_whole_s=towers_off)
        save_records(args.json, "vision_split", argv, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
