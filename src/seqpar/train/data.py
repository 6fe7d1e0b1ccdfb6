"""Training rows for ``seqpar train``: local text / JSONL / JSON / Parquet files through ``datasets``, packed.

Documents are tokenised, ended with an end-of-document token, and packed into rows with position ids that
restart at every document (``seqpar.pack_documents``), so packed documents never attend to each other.
Rank 0 does it once per run directory; the other ranks memory-map the result.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist

from seqpar.data import pack_documents
from seqpar.errors import SeqparInputError

_KEYS = ("input_ids", "position_ids", "attention_mask")
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_tokenizer(path: str | None) -> object:
    """A tokenizer from a local directory (transformers ``AutoTokenizer``), or the byte tokenizer for None.

    Raises:
        SeqparInputError: a directory transformers cannot load a tokenizer from.
    """
    if path is None:
        from seqpar.train.tokenizer import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:
        raise SeqparInputError(f"cannot load a tokenizer from {path}: {str(error).splitlines()[0]}") from error


def _encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode") and not hasattr(tokenizer, "add_special_tokens"):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _cache_key(files: list[str], tokenizer, seq_len: int, text_field: str) -> str:
    """Names the packed rows of exactly these files (paths, sizes, mtimes), tokenizer and row length."""
    parts = [str(seq_len), text_field, type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", ""))]
    parts.append(str(getattr(tokenizer, "vocab_size", "")))
    for f in files:
        stat = os.stat(f)
        parts += [os.path.abspath(f), str(stat.st_size), str(stat.st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _pack_files(files: list[str], tokenizer, seq_len: int, text_field: str) -> dict[str, np.ndarray]:
    kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise SeqparInputError(f"data files must all be of one kind among {sorted(_BUILDERS)}; got {', '.join(files)}")
    import datasets

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    except Exception as error:
        raise SeqparInputError(f"cannot read data files {', '.join(files)}: {str(error).splitlines()[0]}") from error
    if text_field not in table.column_names:
        raise SeqparInputError(f"data has no column {text_field!r} (columns: {table.column_names}); set --text-field")
    eos = getattr(tokenizer, "eos_token_id", None)
    docs = []
    for text in table[text_field]:
        if text:
            ids = _encode(tokenizer, str(text))
            docs.append(ids + ([eos] if eos is not None else []))
    pad = getattr(tokenizer, "pad_token_id", None)
    rows = pack_documents(docs, seq_len, pad_token_id=pad if pad is not None else 0)
    if not rows:
        raise SeqparInputError(f"no text found in {', '.join(files)}")
    return {key: torch.stack([r[key] for r in rows]).numpy().astype(np.int64) for key in _KEYS}


def _build_once(build, directory: str) -> None:
    """Rank 0 runs ``build(directory)``; every rank raises its error too, or none does (no rank left waiting)."""
    message = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            build(directory)
        except SeqparInputError as error:
            message = [str(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise SeqparInputError(message[0])


class FileRows:
    """Packed rows of local data files, deterministic in the seed.

    Rank 0 tokenises and packs the files once into ``cache_dir`` (``.npy`` files, written to a temporary
    name and renamed); every rank then memory-maps them, so the rows are neither recomputed per rank nor
    held in memory once per rank.
    """

    def __init__(self, files: list[str], tokenizer, seq_len: int, text_field: str, seed: int, cache_dir: str) -> None:
        directory = os.path.join(cache_dir, f"packed-{_cache_key(files, tokenizer, seq_len, text_field)}")

        def build(target: str) -> None:
            if os.path.isdir(target):
                return
            arrays = _pack_files(files, tokenizer, seq_len, text_field)
            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            for key, array in arrays.items():
                np.save(os.path.join(partial, f"{key}.npy"), array)
            os.replace(partial, target)

        _build_once(build, directory)
        self.arrays = {key: np.load(os.path.join(directory, f"{key}.npy"), mmap_mode="r") for key in _KEYS}
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self))}
        return self._orders[epoch]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows for global example indices (each epoch is a new permutation of the rows)."""
        picked = [int(self._order(i // len(self))[i % len(self)]) for i in indices]
        return {key: torch.from_numpy(np.stack([array[r] for r in picked])) for key, array in self.arrays.items()}
