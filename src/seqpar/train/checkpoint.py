"""Checkpoints through ``torch.distributed.checkpoint`` that resume exactly and are never half-written.

A checkpoint is a directory ``step_NNNNNNN`` that exists only once every rank has finished writing it.

Note [atomic checkpoints]
    Every rank writes its part into ``step_NNNNNNN.partial``; after a barrier rank 0 writes
    ``seqpar_complete.json`` (the step and the file list with sizes) inside it and then renames the
    directory to ``step_NNNNNNN``. A crash at any point leaves either a ``.partial`` directory, which
    ``latest_checkpoint`` ignores, or a complete one. Loading checks the marker and the file sizes first,
    so a checkpoint damaged later (truncated or deleted files) raises a clear error instead of loading
    garbage or hanging.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from seqpar.errors import SeqparInputError

__all__ = ["MARKER", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]

MARKER = "seqpar_complete.json"
_NAME = re.compile(r"^step_(\d{7})$")


def _listing(path: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(root, name), path): os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
        if name != MARKER
    }


def save_checkpoint(directory: str, step: int, state: dict) -> str:
    """Write ``state`` for ``step`` (Note [atomic checkpoints]); collective over the default group.

    Args:
        directory: the run's checkpoint directory (created by rank 0 if missing).
        step: the optimizer steps done; names the checkpoint ``step_NNNNNNN``.
        state: model/optimizer state dicts (``get_state_dict``) and plain values.

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
            json.dump({"step": step, "files": _listing(partial)}, f)
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


def load_checkpoint(path: str, state: dict) -> int:
    """Load ``path`` into ``state`` in place (collective) and return its step.

    Raises:
        SeqparInputError: an incomplete or damaged checkpoint, or one that does not fit ``state``.
    """
    step = verify_checkpoint(path)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as error:
        raise SeqparInputError(f"cannot load checkpoint {path}: {str(error).splitlines()[0][:300]}") from error
    return step
