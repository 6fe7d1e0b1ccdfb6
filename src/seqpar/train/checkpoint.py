"""Checkpoints through ``torch.distributed.checkpoint`` that resume exactly and are never half-written.

A checkpoint is a directory ``step_NNNNNNN`` that exists only once every rank has finished writing it.

Note [atomic checkpoints]
    Every rank writes its part into ``step_NNNNNNN.partial``; after a barrier rank 0 writes
    ``seqpar_complete.json`` (the step and the file list with sizes) inside it and then renames the
    directory to ``step_NNNNNNN``. A crash at any point leaves either a ``.partial`` directory, which
    ``latest_checkpoint`` ignores, or a complete one. Loading checks the marker and the file sizes first,
    so a checkpoint damaged later (truncated or deleted files) raises a clear error instead of loading
    garbage or hanging. The trainer acts on SIGTERM/SIGINT only between steps and ignores repeats while it
    saves, so a second signal cannot cut a save short; SIGKILL can, and leaves a ``.partial`` directory.

Note [checkpoints never run code]
    ``torch.distributed.checkpoint`` stores its ``.metadata`` as a pickle and non-tensor values (optimizer
    settings, the schedule) as ``torch.save`` pickles, and loads both with the full unpickler, which can call
    any importable function. Loading here reads the metadata with an unpickler that admits only the
    metadata classes (plus ``torch.Size``, dtypes, layouts and paths), and the non-tensor values with
    ``torch.load(weights_only=True)``; anything else in either file is refused with a clear error before it
    is called.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from seqpar.errors import SeqparInputError

MARKER = "seqpar_complete.json"
_NAME = re.compile(r"^step_(\d{7})$")


def _listing(path: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(root, name), path): os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
        if name != MARKER
    }


def save_checkpoint(directory: str, step: int, state: dict, layout: dict | None = None) -> str:
    """Write ``state`` for ``step`` (Note [atomic checkpoints]); collective over the default group.

    Args:
        directory: the run's checkpoint directory (created by rank 0 if missing).
        step: the optimizer steps done; names the checkpoint ``step_NNNNNNN``.
        state: model/optimizer state dicts (``get_state_dict``) and plain values.
        layout: how the writing run was laid out (degrees, data-parallel mode), kept in the marker so a
            resume elsewhere can say what it resharded from.

    Returns:
        The final checkpoint path.
    """
    final = os.path.join(directory, f"step_{step:07d}")
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(partial, MARKER), "w") as f:
            json.dump({"step": step, "files": _listing(partial), "layout": layout or {}}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    dist.barrier()
    return final


def latest_checkpoint(directory: str) -> str | None:
    """The complete checkpoint with the highest step under ``directory``, or None."""
    if not os.path.isdir(directory):
        return None
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(directory)
        if (m := _NAME.match(name)) and os.path.isfile(os.path.join(directory, name, MARKER))
    )
    return os.path.join(directory, steps[-1][1]) if steps else None


def verify_checkpoint(path: str) -> int:
    """The step of a complete, undamaged checkpoint.

    Raises:
        SeqparInputError: no marker (half-written or not a seqpar checkpoint), or files missing or resized.
    """
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise SeqparInputError(f"{path} is not a complete seqpar checkpoint (no {MARKER}; it may be half-written)")
    try:
        with open(marker) as f:
            meta = json.load(f)
        step, files = int(meta["step"]), dict(meta["files"])
    except (ValueError, KeyError, TypeError) as error:
        raise SeqparInputError(f"checkpoint {path} has a damaged {MARKER}: {error}") from error
    now = _listing(path)
    damaged = sorted(name for name, size in files.items() if now.get(name) != size)
    if damaged:
        raise SeqparInputError(f"checkpoint {path} is damaged: missing or resized files {', '.join(damaged[:5])}")
    return step


def checkpoint_layout(path: str) -> dict:
    """The layout recorded by the run that wrote the complete checkpoint ``path`` (empty if none was)."""
    with open(os.path.join(path, MARKER)) as f:
        return dict(json.load(f).get("layout") or {})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global but the metadata classes (Note [checkpoints never run code])."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not a checkpoint metadata class)")


def read_metadata(path: str) -> Metadata:
    """Read a DCP checkpoint's ``.metadata`` without running code from it (Note [checkpoints never run code]).

    Args:
        path: the checkpoint directory.

    Returns:
        The metadata: every saved key with its size (tensors) or kind (other values).

    Raises:
        SeqparInputError: the file names anything but metadata classes (a tampered or foreign file), or it
            is unreadable.
    """
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ValueError) as error:
        raise SeqparInputError(f"checkpoint {path} has an unsafe or unreadable {file}: {error}") from error
    if not isinstance(metadata, Metadata):
        raise SeqparInputError(f"checkpoint {path}: {file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``read_metadata`` (no code from the file runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read with the restricted unpickler."""
        if kwargs.get("rank") is not None:  # per-rank metadata files are not written by save_checkpoint
            raise SeqparInputError("per-rank DCP metadata files are not supported")
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Check ``value`` with the weights-only unpickler, then hand the plain value it holds on."""
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            lines = [line for line in str(error).splitlines() if "Unsupported global" in line or "GLOBAL" in line]
            first = (lines or str(error).strip().splitlines())[0].strip()[:200]
            raise SeqparInputError(f"checkpoint value {read_item.dest_index.fqn} is not plain data: {first}") from error
        checked = io.BytesIO()
        torch.save(plain, checked)  # what the parent planner unpickles is now this, written here
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _flat_tensors(state: dict, prefix: str = "") -> dict[str, torch.Size]:
    """Global shapes of the tensors in nested ``state``, keyed as DCP flattens them ("model.layers.0.weight")."""
    shapes = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            shapes.update(_flat_tensors(value, name + "."))
        elif isinstance(value, torch.Tensor):
            shapes[name] = value.shape  # a DTensor's shape is the global one, as the metadata records it
    return shapes


def _check_fits(path: str, metadata: Metadata, state: dict) -> None:
    """Raise a clear error naming the parameters that differ between the checkpoint's model and ``state``'s."""
    saved = {
        key: entry.size
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    here = {k: v for k, v in _flat_tensors(state).items() if k.startswith("model.")}
    problems = [
        f"{key[6:]} is {list(saved[key])} in the checkpoint but {list(here[key])} here"
        for key in sorted(saved.keys() & here.keys())
        if tuple(saved[key]) != tuple(here[key])
    ]
    problems += [f"{key[6:]} is missing from the checkpoint" for key in sorted(here.keys() - saved.keys())]
    problems += [f"{key[6:]} is in the checkpoint but not in this model" for key in sorted(saved.keys() - here.keys())]
    if problems:
        more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
        raise SeqparInputError(
            f"checkpoint {path} was written for a different model shape: {'; '.join(problems[:4])}{more} "
            "(resume with the model settings it was written with: --model, --hidden-size, --layers, --heads)"
        )


def load_checkpoint(path: str, state: dict) -> int:
    """Load ``path`` into ``state`` in place (collective) and return its step.

    Every rank reads and checks the marker and the metadata before the collective load starts, so the errors
    below are raised on every rank alike. Tensors are resharded to ``state``'s layout (any dp x sp x tp, any
    data-parallel mode) by ``torch.distributed.checkpoint``; nothing in the files is executed.

    Raises:
        SeqparInputError: an incomplete or damaged checkpoint, unsafe metadata or values (Note [checkpoints
            never run code]), a different model shape (the parameters named), or one that does not fit
            ``state`` otherwise.
    """
    step = verify_checkpoint(path)
    _check_fits(path, read_metadata(path), state)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except CheckpointException as error:  # a BaseException holding each failed rank's exception
        causes = [cause for cause, _trace in error.failures.values()]
        ours = [cause for cause in causes if isinstance(cause, SeqparInputError)]
        if ours:
            raise SeqparInputError(str(ours[0])) from error
        first = (str(causes[0]) if causes else str(error)).strip().splitlines() or [""]
        raise SeqparInputError(f"cannot load checkpoint {path}: {first[0][:300]}") from error
    except Exception as error:
        raise SeqparInputError(f"cannot load checkpoint {path}: {str(error).splitlines()[0][:300]}") from error
    return step
