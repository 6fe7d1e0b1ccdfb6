"""``seqpar plan``: the layouts it enumerates are valid and complete, rejections say why, the wire volumes are
the strategies' analytical ones, published maximum lengths are reproduced, JSON and bad input behave.

No process groups: the planner is arithmetic over a model's sizes and a cluster's rates.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import seqpar
from seqpar.cli import main as cli_main
from seqpar.memory import FEATURES
from seqpar.models import ModelSizes
from seqpar.planning import Cluster, Layout, load_model_shape, max_seq_len, model_flops, plan, step_time
from seqpar.planning.cli import parse_tokens
from seqpar.planning.cluster import Calibration, load_calibration, save_calibration
from seqpar.sequence_parallel.strategies.registry import head_split

TINY = ModelSizes(256, 768, 4, 8, 4, 4096)  # python -m benchmarks.llama_step's model


def test_every_layout_is_valid_and_ranked():
    cluster = Cluster(gpus=64, gpus_per_node=8)
    result = plan("llama-8b", 2**20, cluster)
    model = result.model
    assert result.candidates, "a 1M-token Llama-8B plan on 64 x 80 GB has layouts that fit"
    rates = [c.tokens_per_s_per_gpu for c in result.candidates]
    assert all(b <= a * (1 + 1e-5) for a, b in zip(rates, rates[1:]))  # fastest first (ties to 6 digits)
    for c in result.candidates:
        lay = c.layout
        assert lay.pp * lay.dp * lay.sp * lay.tp == cluster.gpus
        assert model.num_attention_heads % lay.tp == 0 and model.num_key_value_heads % lay.tp == 0
        assert lay.sp % lay.ulysses == 0 and lay.ulysses * lay.tp <= cluster.gpus_per_node
        per_tp = (model.num_attention_heads // lay.tp, model.num_key_value_heads // lay.tp)
        assert head_split(*per_tp, lay.ulysses) is not None
        want = {"ulysses": lay.sp, "ring": 1, "allgather": 1, "local": 1}.get(lay.strategy)
        assert lay.ulysses == want if want is not None else 1 < lay.ulysses < lay.sp
        assert c.peak_bytes <= cluster.memory_bytes
        assert 0 < c.mfu < 1
    assert seqpar.plan is plan and isinstance(result, seqpar.Plan)


def test_enumeration_is_complete_on_a_small_cluster():
    # 4 devices, 2 per node, 8/4 heads: tp 4 spans nodes; ulysses x tp must stay within 2
    # one micro-batch per step: no pipeline-parallel layouts (pp 2 and 4 would need at least as many)
    result = plan(TINY, 4096, Cluster(gpus=4, gpus_per_node=2), dp_modes=("replicate",), pp_microbatches=1)
    families = {(c.layout.dp, c.layout.sp, c.layout.ulysses, c.layout.tp, c.layout.strategy) for c in result.candidates}
    expected = {
        (4, 1, 1, 1, "local"),
        (2, 2, 1, 1, "ring"),
        (2, 2, 1, 1, "allgather"),
        (2, 2, 2, 1, "ulysses"),
        (1, 4, 1, 1, "ring"),
        (1, 4, 1, 1, "allgather"),
        (1, 4, 2, 1, "hybrid"),
        (2, 1, 1, 2, "local"),
        (1, 2, 1, 2, "ring"),
        (1, 2, 1, 2, "allgather"),
    }
    assert families == expected
    reasons = {r.family: r.reason for r in result.rejected}
    assert "spans nodes" in reasons["tp 4"] and "more pipeline stages than 1 micro-batches" in reasons["pp 2"]
    assert "spans nodes" in reasons["dp 1 sp 4 tp 1 ulysses replicate"]
    assert "spans nodes" in reasons["dp 1 sp 2 tp 2 ulysses replicate"]
    # 12 feature sets (offload only with checkpointing) for every family
    assert result.considered == 12 * len(expected)


def test_rejection_reasons():
    few_heads = ModelSizes(384, 1024, 2, 3, 1, 1000)  # 3 query heads: ulysses over 4 ranks would leave one idle
    result = plan(few_heads, 8192, Cluster(gpus=4, gpus_per_node=4), dp_modes=("fsdp",))
    reasons = {r.family: r.reason for r in result.rejected}
    assert "ulysses at tp 1 over 4 ranks needs at least 4 query heads" in reasons["dp 1 sp 4 tp 1 ulysses fsdp"]
    assert "do not divide by 2" in reasons["tp 2"]
    tight = plan("llama-8b", 2**20, Cluster(gpus=8, gpu_memory_gb=16))
    assert not tight.candidates
    assert all("does not fit" in r.reason for r in tight.rejected if r.family.startswith("dp 1 sp 8 tp 1"))
    odd_length = plan(TINY, 1000, Cluster(gpus=16, gpus_per_node=16), dp_modes=("fsdp",))
    assert "does not divide by sp 16" in {r.family: r.reason for r in odd_length.rejected}["sp 16 tp 1"]


def test_uneven_ulysses_time_counts_the_busiest_rank():
    # 6 query / 2 KV heads over 4 ranks: query heads 2, 2, 1, 1, KV heads {0}, {0, 1}, {1}, {1} (Note [uneven heads])
    p, seq, e = 4, 8192, 4
    model = ModelSizes(384, 1536, 1, 6, 2, 1000)  # head dim 64
    local, link = seq // p, 1e9
    cluster = Cluster(gpus=p, gpus_per_node=p, gpu_tflops=1e9, intra_node_gbps=2.0, link_efficiency=1.0)
    ulysses = step_time(model, seq, Layout(1, p, p, 1, "ulysses"), cluster, dtype_bytes=e)
    # rank 1 sends 2 (6 - 2) + 2 * 3 * 2 query heads' and 2 (5 - 2) + 2 * 3 * 2 KV heads' worth of its tokens
    assert ulysses.all_to_all * link == pytest.approx((8 + 12 + 6 + 12) * local * 64 * e, rel=1e-9)
    # with free links the slowest rank's attention is 2 heads against the ring's even 1.5
    fast = Cluster(gpus=p, gpus_per_node=p, intra_node_gbps=1e9)
    uneven = step_time(model, seq, Layout(1, p, p, 1, "ulysses"), fast, dtype_bytes=e).attention
    ring = step_time(model, seq, Layout(1, p, 1, 1, "ring"), fast, dtype_bytes=e).attention
    assert uneven == pytest.approx(ring * 2 / 1.5, rel=1e-6)


def test_wire_time_is_the_analytical_volume():
    # On a cluster with free compute, each part's seconds x link rate is the bytes tests/test_bytes_sent.py checks.
    p, seq, e = 4, 8192, 4
    model = ModelSizes(512, 1536, 1, 8, 2, 1000)
    link = 1e9  # one-way bytes/s: intra 2 GB/s both ways, efficiency 1
    cluster = Cluster(gpus=p, gpus_per_node=p, gpu_tflops=1e9, intra_node_gbps=2.0, link_efficiency=1.0)
    local = seq // p
    q_bytes, kv1 = 8 * local * 64 * e, 2 * local * 64 * e
    ulysses = step_time(model, seq, Layout(1, p, p, 1, "ulysses"), cluster, dtype_bytes=e)
    kv_p = 4 * local * 64 * e  # 2 KV heads copied up to 4 for the all-to-all over 4 ranks
    assert ulysses.all_to_all * link == pytest.approx((p - 1) / p * 4 * (q_bytes + kv_p), rel=1e-9)
    ring = step_time(model, seq, Layout(1, p, 1, 1, "ring"), cluster, dtype_bytes=e)
    hop = 2 * kv1  # K and V of one hop: the one transfer compute cannot hide
    assert ring.attention * link == pytest.approx((p - 1) * 4 * kv1 + p * 2 * kv1 + hop, rel=1e-6)
    checkpointed = step_time(model, seq, Layout(1, p, p, 1, "ulysses", ("checkpointing",)), cluster, dtype_bytes=e)
    assert checkpointed.all_to_all == pytest.approx(ulysses.all_to_all * 6 / 4)  # the forward exchanges again


ALL_FEATURES = (*FEATURES, "offload_optimizer")  # what ALST's recipes switch on (below)


@pytest.mark.parametrize(
    ("gpus", "published"),
    [(8, 3.7e6), (32, 15e6)],
    ids=["8xH100-3.7M", "32xH100-15M"],
)
def test_published_max_length(gpus, published):
    # Arctic Long Sequence Training (ALST), arXiv:2506.13996, abstract: Llama 8B (Llama-3.1-8B) trains at
    # 3.7M tokens on one 8xH100 node and over 15M on 4 nodes (32 H100s), with Ulysses SP over all GPUs,
    # bf16, tiled loss and MLP, checkpointed hidden states offloaded to the CPU, and ZeRO-3 with the optimizer
    # state offloaded to the CPU (ArcticTraining projects/sequence-parallelism/run-h100-sp8-llama-8b.yml:
    # zero_optimization stage 3, offload_optimizer device cpu, cpu_adam, max_length 3,800,000). H100 "80 GB":
    # 80 GiB (CUDA shows 81,559 MiB), of which the planner fills 90%. Tolerance: 25% below or above.
    layout = Layout(1, gpus, gpus, 1, "ulysses", ALL_FEATURES, "fsdp")
    cluster = Cluster(gpus=gpus, gpus_per_node=8, gpu_memory_gb=80, ulysses_across_nodes=True)
    longest = max_seq_len("llama-8b", layout, cluster)
    assert abs(longest / published - 1) <= 0.25, f"{longest:,} tokens vs published {published:,.0f}"
    # the same cluster without the memory features trains far shorter sequences (ALST: 32K at 1 GPU baseline)
    plain = max_seq_len("llama-8b", Layout(1, gpus, gpus, 1, "ulysses", (), "fsdp"), cluster)
    assert plain < longest / 4


def test_published_single_gpu_max_length_needs_optimizer_offload(tmp_path, capsys):
    # ALST (arXiv:2506.13996), abstract: Llama-3.1-8B trains at 500K tokens on a single H100
    # 80GB. Its 1-GPU recipe (ArcticTraining projects/sequence-parallelism/run-h100-sp1-llama-8b.yml,
    # max_length 500,000): sequence_parallel_size 1, ZeRO-3 with offload_optimizer and offload_param to the
    # CPU (cpu_adam), activation_checkpoint_cpu_offload, tiled_mlp_compute, Liger's tiled loss, bf16: FSDP2's
    # CPUOffloadPolicy plus seqpar's four activation features. Weights, gradients and Adam state of 8B in
    # mixed precision (~128 GB) cannot stay on the card.
    published = 500_000
    one = Cluster(gpus=1, gpu_memory_gb=80)
    assert one.memory_bytes == pytest.approx(80 * 2**30 * 0.9)  # "80 GB" as labelled = 80 GiB
    longest = max_seq_len("llama-8b", Layout(1, 1, 1, 1, "local", ALL_FEATURES, "fsdp"), one)
    assert abs(longest / published - 1) <= 0.25, f"{longest:,} tokens vs published {published:,}"
    # without offload the 1-GPU maximum is far shorter (ALST: 32K for the plain Hugging Face baseline)
    for mode in ("fsdp", "replicate"):
        on_card = max_seq_len("llama-8b", Layout(1, 1, 1, 1, "local", FEATURES, mode), one)
        assert on_card < longest / 4, (mode, on_card)
    # the planner finds it: every layout that fits 500K (K = 1024) on one 80 GB card offloads the optimizer
    result = plan("llama-8b", 500 * 1024, one)
    assert result.candidates and all("offload_optimizer" in c.layout.features for c in result.candidates)
    best = result.top(1)[0]
    assert best.layout.dp_mode == "fsdp" and best.peak_bytes <= one.memory_bytes
    assert best.memory.host > 16 * 8.03e9  # fp32 master, gradients, AdamW state on the host
    assert best.time.offload > 0 and result.considered == 12 + 24  # replicate: 12 feature sets, fsdp: 24
    out = tmp_path / "one.json"
    argv = ["plan", "--model", "llama-8b", "--seq-len", "500K", "--gpus", "1", "--gpu-memory-gb", "80"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "| 1 | 1 | 1 | 1 | 1 | local | fsdp | checkpointing+chunked_loss+tiled_mlp+offload+offload_optimizer |"
        in printed
    )
    assert "80 GiB x 0.9 usable" in printed
    top = json.loads(out.read_text())["top"][0]
    assert "offload_optimizer" in top["features"] and top["peak_bytes"] <= one.memory_bytes < top["host_bytes"]
    # offload costs time (host copies, AdamW on the host), so the planner takes it only when nothing else fits
    short = plan("llama-8b", 32 * 1024, one)
    assert "offload_optimizer" not in short.top(1)[0].layout.features
    node = plan("llama-8b", 2**20, Cluster(gpus=8))
    assert node.candidates and "offload_optimizer" not in node.top(1)[0].layout.features


@pytest.mark.parametrize(
    ("seq_k", "gpus", "tp", "dp", "cp", "published"),
    [(128, 128, 4, 8, 4, 555), (256, 256, 4, 8, 8, 549), (512, 512, 8, 4, 16, 549), (1024, 1024, 8, 4, 32, 536)],
)
def test_published_throughput(seq_k, gpus, tp, dp, cp, published):
    # NVIDIA NeMo Framework 24.12, "Long Sequence Performance", table "LLAMA2-7B (FP8)": TFLOPS per GPU of
    # Llama-2-7B pre-training on H100s with context parallelism (a ring over CP ranks), at the TP / PP 1 / DP /
    # CP of each row (docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/
    # performance_long_sequence.html). Planner: H100 SXM dense FP8 peak 1979 TFLOP/s, its default efficiencies
    # (matmul 0.6, attention 0.45, links 0.75; not fitted to these rows), DDP-style overlapped gradients.
    # NeMo's FLOP count may differ from the planner's (causal attention counted as half); tolerance 15%.
    cluster = Cluster(gpus=gpus, gpus_per_node=8, gpu_tflops=1979)
    seq = seq_k * 1024
    time = step_time(load_model_shape("llama2-7b"), seq, Layout(dp, cp, 1, tp, "ring", (), "ddp"), cluster)
    predicted = model_flops(load_model_shape("llama2-7b"), seq) * dp / time.total / gpus / 1e12
    assert abs(predicted / published - 1) <= 0.15, f"{predicted:.0f} TFLOP/s per GPU vs published {published}"


def test_json_output_and_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-8b", "--seq-len", "1M", "--gpus", "64", "--gpus-per-node", "8"]
    assert cli_main([*argv, "--gpu-memory-gb", "80", "--gpu-tflops", "990", "--json", str(out), "--top", "5"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["seq_len"] == 2**20 and len(data["top"]) == 5 and data["fitting"] > 5
    assert data["top"][0]["tokens_per_s_per_gpu"] >= data["top"][-1]["tokens_per_s_per_gpu"]
    assert {"dp", "sp", "ulysses", "tp", "strategy", "features", "peak_bytes", "step_s", "mfu"} <= set(data["top"][0])
    assert all(r["reason"] for r in data["rejected"])
    assert f"| 1 | {data['top'][0]['dp']} | {data['top'][0]['sp']} |" in printed
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(load_model_shape("qwen2.5-7b").as_config()))
    assert cli_main(["plan", "--model", str(config), "--seq-len", "128K", "--gpus", "8"]) == 0
    header = "28 layers x 3584 hidden, 28/4 heads, vocab 152064 (7.62B parameters); seq 131,072 x micro-batch 1, bf16"
    assert header in capsys.readouterr().out


def test_train_plan_prints_its_own_layout(capsys):
    argv = ["train", "--plan", "--sp", "2", "--seq-len", "1024", "--activation-checkpointing"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "these settings: dp 1 sp 2 ulysses 2 tp 1 ulysses replicate, features checkpointing" in printed
    assert "| # | dp | sp |" in printed
    # a length sp does not divide is padded to a multiple of 2 x sp, as training pads it
    assert cli_main(["train", "--plan", "--sp", "3", "--seq-len", "1000"]) == 0
    printed = capsys.readouterr().out
    assert "these settings: dp 1 sp 3 ulysses 1 tp 1 ring replicate" in printed
    assert "1002 tokens per sequence (padded from 1000)" in printed and "seq 1,002 x micro-batch" in printed
    # "auto" on an sp 4 x ulysses 2 mesh with 4/2 heads: hybrid, as select_strategy picks it
    assert cli_main(["train", "--plan", "--sp", "4", "--ulysses", "2", "--seq-len", "1024"]) == 0
    assert "these settings: dp 1 sp 4 ulysses 2 tp 1 hybrid replicate" in capsys.readouterr().out
    # optimizer offload: a feature of the layout, the estimate's host memory, the offload part of the step
    argv = ["train", "--plan", "--sp", "2", "--seq-len", "1024", "--dp-mode", "fsdp", "--offload-optimizer"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "these settings: dp 1 sp 2 ulysses 2 tp 1 ulysses fsdp, features offload_optimizer," in printed
    assert "optimizer offloaded to the host" in printed and "host memory (offloaded" in printed
    assert ", offload " in printed
    assert cli_main(["train", "--plan", "--offload-optimizer"]) == 2  # replicate is the default dp mode
    assert "--offload-optimizer needs --dp-mode fsdp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    assert "--offload-optimizer" in capsys.readouterr().out


def test_pipeline_layouts_in_the_plan(capsys):
    """pp degrees are enumerated (the outermost axis, across nodes allowed); the time model adds the bubble
    (p - 1) / (m + p - 1) of the busiest stage's micro-batch time and the point-to-point traffic."""
    cluster = Cluster(gpus=16, gpus_per_node=8)
    model = load_model_shape("llama-70b")
    flat = Layout(1, 1, 1, 8, "local", ("checkpointing",), "replicate")
    piped = Layout(1, 1, 1, 8, "local", ("checkpointing",), "replicate", pp=2, pp_microbatches=8)
    time = step_time(model, 65536, piped, cluster)
    stage = step_time(replace(model, num_hidden_layers=40), 65536, flat, cluster)
    assert piped.world == 16 and time.bubble == pytest.approx((time.matmul + time.attention + time.tensor_parallel) / 8)
    assert time.matmul == pytest.approx(8 * stage.matmul) and time.pipeline > 0 and flat_bubble(flat, cluster) == 0
    # Llama-70B at 64K on 2 x 8 GPUs without sharded parameters: only a pipeline makes it fit
    result = plan("llama-70b", 65536, cluster, dp_modes=("replicate",))
    assert result.candidates and all(c.layout.pp > 1 for c in result.candidates)
    best = result.candidates[0].layout
    assert best.pp * best.dp * best.sp * best.tp == 16 and best.pp_microbatches == 8
    assert cli_main(["plan", "--model", "llama-70b", "--seq-len", "64K", "--gpus", "16", "--dp-mode", "replicate"]) == 0
    assert f"| {best.tp} | {best.pp} (m 8, " in capsys.readouterr().out
    argv = ["train", "--plan", "--pp", "2", "--sp", "2", "--layers", "4", "--seq-len", "1024"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "these settings: pp 2 (1f1b, 2 micro-batches, bubble 33%) x dp 1 sp 2" in printed
    assert "| pp (bubble) |" in printed and ", bubble " in printed


def flat_bubble(layout: Layout, cluster: Cluster) -> float:
    return step_time(load_model_shape("llama-8b"), 8192, layout, cluster).bubble


def test_large_cluster_plans():
    # timing belongs to benchmarks; here: it runs and finds multi-node layouts for 16M tokens
    result = plan("llama-8b", 16 * 2**20, Cluster(gpus=1024, gpus_per_node=8))
    assert result.candidates and max(c.layout.sp for c in result.candidates) > 8


def test_calibration_round_trip_and_use(tmp_path):
    path = str(tmp_path / "cal.json")
    save_calibration(Calibration(0.05, 0.02, 4.0, 16.0), path)
    cluster = Cluster(gpus=2, gpus_per_node=2).with_calibration(load_calibration(path))
    assert cluster.matmul_flops == pytest.approx(0.05e12) and cluster.attention_flops == pytest.approx(0.02e12)
    assert cluster.intra_bytes_per_s == pytest.approx(2e9)
    (tmp_path / "bad.json").write_text('{"matmul_tflops": -1}')
    with pytest.raises(seqpar.SeqparInputError, match="positive numbers"):
        load_calibration(str(tmp_path / "bad.json"))


def test_bad_input(tmp_path, capsys):
    err = seqpar.SeqparInputError
    with pytest.raises(err, match="neither a preset"):
        plan("no-such-model", 1024, Cluster(gpus=8))
    with pytest.raises(err, match="positive integers"):
        plan("llama-8b", 0, Cluster(gpus=8))
    with pytest.raises(err, match="dtype"):
        plan("llama-8b", 1024, Cluster(gpus=8), dtype="int8")
    few_heads = ModelSizes(384, 1024, 2, 3, 1, 1000)
    with pytest.raises(err, match=r"over 4 ranks needs at least 4 query heads"):
        step_time(few_heads, 8192, Layout(1, 4, 4, 1, "ulysses"), Cluster(gpus=4, gpus_per_node=4))
    with pytest.raises(err, match="do not fill nodes"):
        Cluster(gpus=12, gpus_per_node=8)
    with pytest.raises(err, match="must be positive"):
        Cluster(gpus=8, gpu_tflops=0)
    with pytest.raises(err, match="lacks positive integer"):
        plan({"hidden_size": 64}, 1024, Cluster(gpus=1))
    with pytest.raises(err, match="token count"):
        parse_tokens("lots")
    assert parse_tokens("1M") == 2**20 and parse_tokens("128K") == 131072 and parse_tokens("1000") == 1000
    with pytest.raises(err, match="cannot read calibration"):
        load_calibration(str(tmp_path / "missing.json"))
    assert cli_main(["plan", "--model", "llama-8b", "--seq-len", "-5"]) == 2
    assert cli_main(["plan", "--seq-len", "1M"]) == 2
    assert "--model is required" in capsys.readouterr().err
