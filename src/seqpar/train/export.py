"""The trained model as a Hugging Face model directory: gathered from a run's shards, or read from a checkpoint.

``export_run`` writes ``<run_dir>/hf`` at the end of ``seqpar train``; ``export_checkpoint`` (``seqpar export``)
writes one from any complete checkpoint in one process, without a process group.

Note [hf export]
    The directory holds what ``AutoModelForCausalLM.from_pretrained`` reads: ``config.json`` (the run's model
    config, the one ``seqpar.train.model.model_config`` builds, untouched by ``seqpar.parallelize``),
    ``model.safetensors`` (float32, as trained), ``generation_config.json`` (the ``--model`` directory's, else
    the one transformers derives from the config) and, for ``--data`` runs with a Hugging Face tokenizer, the
    tokenizer's files (the byte tokenizer of the passkey task and of plain data is seqpar's own and is not
    saved). At the end of a run the whole state dict is gathered on global rank 0 with
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: every rank takes part, because each
    FSDP2 or tensor-parallel DTensor is all-gathered over its own mesh (``full_tensor``); under ``--pp`` the
    stages are first broadcast into every pp rank's unsplit model (``gather_stages``), so the names are the
    whole model's and no layer is a stale copy. From a checkpoint the model's tensors are read by
    ``torch.distributed.checkpoint`` into whole tensors of the saved shapes (it reassembles the shards of
    every layout; under ``--pp`` each parameter was saved once, by the rank whose stage held it). Either way
    rank 0 (or the one process) assigns the tensors to a model built on the meta device, refuses names the
    model lacks or parameters left unset, ties the embeddings as the config says (the output head then is
    the embedding and is saved once, as transformers does), and saves with ``save_pretrained`` into
    ``<out>.partial``, renamed to ``<out>`` once complete, so a crash never leaves a half-written directory
    under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.train.checkpoint import SafeFileSystemReader, SafeLoadPlanner, read_metadata, verify_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.data import load_tokenizer
from seqpar.train.model import model_config
from seqpar.train.pipeline import gather_stages

HF_DIR = "hf"
"""The run directory's Hugging Face model directory, written at the end of a run (Note [hf export])."""


def full_model_state(run: object) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on global rank 0, on the CPU (collective over every rank).

    Args:
        run: the run's state (``seqpar.train.state.RunState``).

    Returns:
        Every parameter and persistent buffer, whole, keyed by the model's names, on rank 0; None elsewhere.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gather_stages(run)  # under --pp: every stage's layers into each pp rank's unsplit model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0 only
    state = get_model_state_dict(run.model, options=options)
    return state if dist.get_rank() == 0 else None


def _vocab_size(tokenizer_path: str | None) -> int:
    tokenizer = load_tokenizer(tokenizer_path)
    return getattr(tokenizer, "vocab_size", None) or len(tokenizer)


def write_hf_model(config: TrainConfig, state: dict[str, torch.Tensor], out: str, tokenizer_path: str | None) -> str:
    """Write ``state`` as a Hugging Face model directory ``out`` (Note [hf export]); one process.

    Args:
        config: the run's settings (the model they build, its generation config).
        state: the whole model's tensors keyed by the model's names (the tied output head may be left out).
        out: the directory to write; an existing one is replaced once the new one is complete.
        tokenizer_path: the run's tokenizer directory, saved alongside; None for the byte tokenizer.

    Returns:
        ``out``.

    Raises:
        SeqparInputError: ``state`` names tensors the model lacks, leaves parameters unset, or has other
            shapes than the model's (a checkpoint of another model).
    """
    import transformers

    cfg = model_config(config, _vocab_size(tokenizer_path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as error:  # a size mismatch
        raise SeqparInputError(f"the tensors do not fit the run's model: {str(error).splitlines()[-1]}") from error
    if result.unexpected_keys:
        raise SeqparInputError(f"tensors the run's model does not have: {', '.join(result.unexpected_keys[:5])}")
    model.tie_weights()  # the head is the embedding when the config ties them
    unset = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if unset:
        raise SeqparInputError(f"parameters missing from the model's tensors: {', '.join(unset[:5])}")
    if config.model and os.path.isfile(os.path.join(config.model, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(config.model)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    if tokenizer_path is not None:
        load_tokenizer(tokenizer_path).save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out


def export_run(run: object) -> str | None:
    """Write ``<run_dir>/hf`` from the run's current model (collective over every rank; rank 0 writes).

    Args:
        run: the run's state, after its last optimizer step.

    Returns:
        The directory on rank 0, None elsewhere.
    """
    state = full_model_state(run)
    if state is None:
        return None
    return write_hf_model(run.config, state, os.path.join(run.run_dir, HF_DIR), run.config.tokenizer_path())


def run_settings(path: str) -> tuple[TrainConfig, str | None]:
    """The settings a run recorded in its ``config.json``, and the tokenizer directory it used.

    Args:
        path: the run's ``config.json``.

    Returns:
        The ``TrainConfig`` (fields the file lacks take their defaults) and the tokenizer directory (None: the
        byte tokenizer).

    Raises:
        SeqparInputError: the file is missing or is not a run's settings.
    """
    if not os.path.isfile(path):
        raise SeqparInputError(
            f"run settings not found: {path} (the checkpoint's run directory has none; pass --run-config)"
        )
    try:
        with open(path) as f:
            values = json.load(f)
        known = {name: values[name] for name in TrainConfig.__dataclass_fields__ if name in values}
        config = TrainConfig(**known)
    except (ValueError, TypeError) as error:
        raise SeqparInputError(f"{path} does not hold a seqpar train run's settings: {error}") from error
    return config, values.get("tokenizer_used", config.tokenizer_path())


def _model_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a complete checkpoint, whole, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(checkpoint)
    state = {
        key[len("model.") :]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    if not state:
        raise SeqparInputError(f"checkpoint {checkpoint} holds no model tensors")
    loaded = {"model": state}
    try:
        with warnings.catch_warnings():  # no process group is what this reader is for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(loaded, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    except Exception as error:
        raise SeqparInputError(f"cannot read checkpoint {checkpoint}: {str(error).splitlines()[0][:300]}") from error
    return loaded["model"]


def export_checkpoint(checkpoint: str, out: str, run_config: str | None = None) -> str:
    """Write a Hugging Face model directory from a complete ``seqpar train`` checkpoint (one process).

    Args:
        checkpoint: a ``<run_dir>/checkpoints/step_NNNNNNN`` directory, written at any layout.
        out: the directory to write: new, or empty.
        run_config: the run's ``config.json``; default: the one in the checkpoint's run directory.

    Returns:
        ``out``.

    Raises:
        SeqparInputError: a missing, incomplete or damaged checkpoint, an ``out`` that is not empty, run
            settings that cannot be found or read, or a checkpoint of another model than they build.
    """
    if not os.path.isdir(checkpoint):
        raise SeqparInputError(f"checkpoint directory not found: {checkpoint}")
    verify_checkpoint(checkpoint)  # complete and undamaged
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise SeqparInputError(f"{out} exists and is not an empty directory; choose a new one")
    default = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.json")
    config, tokenizer_path = run_settings(run_config or default)
    state = _model_tensors(checkpoint)
    if os.path.isdir(out):
        os.rmdir(out)
    return write_hf_model(config, state, out, tokenizer_path)
