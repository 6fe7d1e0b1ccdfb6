"""Everything ``seqpar train`` can be told, as one dataclass: defaults, then a config file, then flags.

The defaults are the embedded demo: a small Llama learning pass-key recitation with the sequence over 2 CPU ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields

from seqpar.errors import SeqparInputError
from seqpar.mesh import ParallelDims
from seqpar.parallel import ParallelizeOptions
from seqpar.sequence_parallel.layouts.chunks import layout_names, named_layout
from seqpar.sequence_parallel.strategies.registry import STRATEGIES
from seqpar.train.pipeline_config import pipeline_problems

TRAIN_LAYOUTS = layout_names()
"""``--layout`` choices: every name of the layout registry (Note [layout registry]); per-batch ones solve each batch."""


@dataclass
class TrainConfig:
    """One training run. Every field is a ``--flag`` (underscores become dashes) and a config-file key."""

    # --- model and data
    model: str | None = None
    """Local Hugging Face model directory (config.json, optional weights) or a config.json file; default: a
    small Llama built from an embedded config (random weights)."""
    tokenizer: str | None = None
    """Local tokenizer directory for --data files; default: the --model directory's tokenizer if it has one,
    else seqpar's byte tokenizer (the passkey task always uses the byte tokenizer)."""
    data: list[str] = field(default_factory=list)
    """Local .txt / .jsonl / .json / .parquet files, packed into rows of seq_len tokens with document
    boundaries kept; default: the synthetic pass-key recitation task (seqpar.train.passkey)."""
    text_field: str = "text"
    """Column holding the text in JSONL/JSON/Parquet files."""
    hidden_size: int = 128
    """Width of the embedded default model."""
    layers: int = 2
    """Layers of the embedded default model."""
    heads: int = 4
    """Attention heads of the embedded default model (KV heads: half of them)."""

    # --- parallelism
    strategy: str = "auto"
    """Attention strategy: ulysses, ring, allgather, hybrid or auto."""
    sp: int = 2
    """Sequence-parallel degree (ranks that share one sequence)."""
    ulysses: int = 1
    """Ulysses degree inside sp (hybrid: ulysses x ring); must divide sp."""
    layout: str = "zigzag"
    """Which tokens of a row each sp rank holds: zigzag (even causal work for one document per row), contiguous,
    balanced, placed or auto (each batch's own, Notes [balanced layout], [placed layout]; not with --pp)."""
    dp: int = 1
    """Data-parallel degree; the world size must equal pp x dp x sp x tp."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP of each block split over tp ranks; the world size is
    pp x dp x sp x tp."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder layers cut into pp stages balanced by parameters, one per rank of
    the "pp" axis; the world size is pp x dp x sp x tp (Note [pipeline in seqpar train])."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule with --pp > 1: gpipe, 1f1b or interleaved (interleaved 1F1B, two stages per rank)."""
    pp_microbatches: int | None = None
    """Pieces each accumulated batch is cut into in the pipeline: at least --pp, dividing batch-size /
    grad-accum (interleaved: a multiple of --pp); default --pp."""
    dp_mode: str = "replicate"
    """How parameters live on the dp x sp ranks: replicate (gradients summed by one all-reduce), ddp, or
    fsdp (FSDP2: parameters, gradients and optimizer state sharded); gradients are summed, never averaged."""
    offload_optimizer: bool = False
    """Keep the sharded parameters (the fp32 master copy), their gradients and the AdamW state in host memory
    and run the optimizer step on the CPU (FSDP2's CPUOffloadPolicy, ZeRO-3 offload); during the step only
    about two layers' gathered parameters and gradients and the embeddings and output head visit the GPU.
    Needs --dp-mode fsdp; works at any dp x sp, 1 included. On the CPU it only changes the code path."""
    nproc: int | None = None
    """Ranks to spawn on this machine when not started by torchrun; default pp x dp x sp x tp."""
    timeout_s: int = 600
    """Seconds a collective waits for the other ranks before the run fails, naming the rank and the step or
    phase it was in (a stalled rank, a lost node); it must cover packing --data files on rank 0."""

    # --- optimisation
    seq_len: int = 512
    """Tokens per training sequence (the whole sequence, before it is split over sp ranks)."""
    batch_size: int = 8
    """Sequences per optimizer step and data-parallel replica, over all micro-batches."""
    grad_accum: int = 2
    """Micro-batches per optimizer step (batch_size must divide by it)."""
    steps: int = 300
    """Optimizer steps."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine schedule)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    lr_schedule: str = "cosine"
    """cosine, linear or constant (after warm-up)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    loss_chunk: int = 0
    """Tokens per piece of the output projection and loss, so the [seq/sp, vocab] logits never exist at
    once (0: whole logits; with --dp-mode replicate only)."""
    precision: str = "fp32"
    """fp32 or bf16 (bf16 autocast; parameters and optimizer state stay fp32)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them."""
    tiled_mlp: bool = False
    """Run each decoder MLP over chunks of --tiled-mlp-chunk tokens and recompute it a chunk at a time in the
    backward, so only one chunk's [tokens, intermediate] activations exist at once (same results)."""
    tiled_mlp_chunk: int = 1024
    """Tokens per chunk of the tiled MLP (this rank's tokens, batch and sequence together)."""
    offload_activations: bool = False
    """Keep each checkpointed layer's input hidden states in pinned CPU memory until its backward, copied on a
    side CUDA stream (needs --activation-checkpointing; does nothing without CUDA)."""
    max_memory_mb: float | None = None
    """Per-rank device memory budget in MiB (2^20 bytes; an "80 GB" H100 shows 81559 MiB in nvidia-smi):
    refuse to start a run whose predicted peak (seqpar.estimate_memory) exceeds it, naming the smallest sp or
    the feature that would fit (default: no check). Host memory (--offload-optimizer) is printed, not checked."""
    seed: int = 0
    """Seed of the model initialisation and of the synthetic data."""

    # --- run directory, logging, checkpoints, evaluation
    run_dir: str | None = None
    """Where config, metrics, TensorBoard logs, plots and checkpoints go; default runs/<date-time>."""
    log_every: int = 10
    """Steps between metric lines (metrics.jsonl and TensorBoard get every step)."""
    save_every: int = 100
    """Steps between checkpoints (and one at the end; 0: only at the end)."""
    resume: str | None = None
    """Checkpoint directory to resume from, or "auto" for the latest complete one in run_dir."""
    stop_at: int | None = None
    """Save a checkpoint and stop after this step (the schedule still counts to steps)."""
    eval_examples: int = 32
    """Held-out pass-key examples per evaluated length."""
    eval_lengths: list[int] = field(default_factory=list)
    """Sequence lengths to evaluate at; default: seq_len and 2 x seq_len (never trained on)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    export_hf: bool = True
    """At the end of the run, write the trained model as a Hugging Face model directory, <run_dir>/hf
    (config.json, model.safetensors, generation config, the --data tokenizer), gathered from every rank's
    shards and pipeline stages (Note [hf export]); ``seqpar export`` writes one from any checkpoint."""
    plan: bool = False
    """Print the predicted per-rank memory and step time of these settings, and the ranked layouts of
    ``seqpar plan`` for the same model, length and device count (H100-class devices), then exit."""

    def validate(self) -> None:
        """Raise ``SeqparInputError`` for settings that cannot work, before any rank starts.

        The world size is not known here (torchrun sets it); ``seqpar.train.launch`` checks pp x dp x sp x tp
        against it.

        Raises:
            SeqparInputError: every problem found, one per line.
        """
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        for name in ("pp", "sp", "ulysses", "dp", "tp", "seq_len", "batch_size", "grad_accum", "steps", "timeout_s"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1")
        if self.layout not in TRAIN_LAYOUTS:
            problems.append(f"--layout must be {', '.join(TRAIN_LAYOUTS)}, not {self.layout!r}")
        elif named_layout(self.layout).per_batch and self.pp > 1:  # one layout per batch
            problems.append(
                f"--layout {self.layout} cannot be combined with --pp > 1: the pipeline stages are told one layout "
                f"when they are built, and {self.layout} gives every batch its own; use --layout zigzag with --pp"
            )
        if all(getattr(self, name) >= 1 for name in ("pp", "sp", "ulysses", "dp", "tp")):
            try:
                self.dims()
            except SeqparInputError:  # the one degree rule ParallelDims adds: said with the flags' names
                problems.append(f"--ulysses {self.ulysses} must divide --sp {self.sp}")
        if self.batch_size >= 1 and self.grad_accum >= 1 and self.batch_size % self.grad_accum:
            problems.append(f"--batch-size {self.batch_size} must be divisible by --grad-accum {self.grad_accum}")
        if self.dp_mode not in ("replicate", "ddp", "fsdp"):
            problems.append(f"--dp-mode must be replicate, ddp or fsdp, not {self.dp_mode!r}")
        elif self.dp_mode != "replicate" and self.tp > 1:
            problems.append("--dp-mode ddp/fsdp with --tp > 1 is not supported; use --dp-mode replicate")
        if self.offload_optimizer and self.dp_mode != "fsdp":
            problems.append(
                f"--offload-optimizer needs --dp-mode fsdp (FSDP2 shards and offloads the parameters, gradients "
                f"and optimizer state), not {self.dp_mode}: add --dp-mode fsdp"
            )
        problems += pipeline_problems(self)
        if self.tokenizer and not self.data:
            problems.append("the passkey task uses seqpar's byte tokenizer; --tokenizer applies to --data files")
        if self.loss_chunk < 0:
            problems.append("--loss-chunk must be 0 (off) or a positive number of tokens")
        elif self.loss_chunk and self.dp_mode != "replicate":
            problems.append("--loss-chunk needs --dp-mode replicate (ddp/fsdp wrap the whole model's forward)")
        if self.max_memory_mb is not None and self.max_memory_mb <= 0:
            problems.append("--max-memory-mb must be a positive number of MiB")
        if self.tiled_mlp_chunk < 1:
            problems.append("--tiled-mlp-chunk must be a positive number of tokens")
        if self.offload_activations and not self.activation_checkpointing:
            problems.append(
                "--offload-activations moves the layer inputs that activation checkpointing keeps: "
                "add --activation-checkpointing"
            )
        if self.precision not in ("fp32", "bf16"):
            problems.append(f"--precision must be fp32 or bf16, not {self.precision!r}")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            problems.append(f"--lr-schedule must be cosine, linear or constant, not {self.lr_schedule!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            problems.append(f"--stop-at must be between 1 and --steps ({self.steps})")
        for path in [*self.data, *(p for p in (self.model, self.tokenizer) if p)]:
            if not os.path.exists(path):
                problems.append(f"file or directory not found: {path}")
        if self.resume not in (None, "auto") and not os.path.isdir(self.resume):
            problems.append(f"checkpoint directory not found: {self.resume}")
        if problems:
            raise SeqparInputError("invalid training settings:\n  - " + "\n  - ".join(problems))

    def dims(self, sp: int | None = None) -> ParallelDims:
        """The run's degrees: --pp, --dp (sharded under --dp-mode fsdp), --sp, --ulysses, --tp.

        Args:
            sp: another sequence-parallel degree instead of --sp (the memory check's alternatives).

        Raises:
            SeqparInputError: a degree below 1, or --ulysses not dividing the sequence-parallel degree.
        """
        dp = {"dp_shard_size" if self.dp_mode == "fsdp" else "dp_replicate_size": self.dp}
        return ParallelDims(**dp, sp_size=sp or self.sp, ulysses_size=self.ulysses, tp_size=self.tp, pp_size=self.pp)

    def parallelize_options(self) -> ParallelizeOptions:
        """What ``seqpar.parallelize`` applies for this run (--dp-mode replicate: no wrapper, gradients summed by
        the step's ``reduce_gradients``)."""
        return ParallelizeOptions(
            strategy=self.strategy,
            layout=self.layout,
            dp_mode=None if self.dp_mode == "replicate" else self.dp_mode,
            offload_optimizer=self.offload_optimizer,
            activation_checkpointing=self.activation_checkpointing,
            tiled_mlp=self.tiled_mlp,
            tiled_mlp_chunk=self.tiled_mlp_chunk,
            offload_activations=self.offload_activations,
        )

    def tokenizer_path(self) -> str | None:
        """The tokenizer directory to load, or None for the byte tokenizer."""
        if not self.data:
            return None
        if self.tokenizer:
            return self.tokenizer
        files = ("tokenizer.json", "tokenizer_config.json")
        if self.model and os.path.isdir(self.model) and any(os.path.exists(os.path.join(self.model, f)) for f in files):
            return self.model
        return None

    def to_dict(self) -> dict:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)


def _field_help(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal after each field) read from the class source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per ``TrainConfig`` field (default None: unset flags do not override the config file)."""
    parser.add_argument("--config", help="YAML or JSON file with any of the settings below (flags override it)")
    docs = _field_help(TrainConfig)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f"{docs.get(f.name, '')} (default: {default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.type.startswith("list"):
            item = int if "int" in f.type else str
            parser.add_argument(flag, nargs="+", type=item, default=None, help=text)
        else:
            kind = int if f.type.startswith("int") else float if f.type.startswith("float") else str
            choices = {"layout": TRAIN_LAYOUTS}.get(f.name)  # listed in --help; bad ones exit 2 with the choices
            parser.add_argument(flag, type=kind, default=None, choices=choices, help=text)
    return parser


def _read_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise SeqparInputError(f"config file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as error:
        raise SeqparInputError(f"cannot parse config file {path}: {error}") from error
    if not isinstance(data, dict):
        raise SeqparInputError(f"config file {path} must hold a mapping of settings")
    known = {f.name for f in fields(TrainConfig)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SeqparInputError(f"unknown settings in {path}: {', '.join(unknown)}")
    return data


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, overridden by ``--config`` file values, overridden by flags given on the command line.

    Raises:
        SeqparInputError: a missing, unreadable or unknown-key config file, or settings that cannot work.
    """
    values = _read_config_file(args.config) if getattr(args, "config", None) else {}
    for f in fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    config = TrainConfig(**values)
    config.validate()
    return config
