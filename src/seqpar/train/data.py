"""Training rows for ``seqpar train``: local text / JSONL / JSON / Parquet files through ``datasets``, packed.

Documents are tokenised, ended with an end-of-document token, and packed into rows with position ids that
restart at every document (``seqpar.pack_documents``), so packed documents never attend to each other.
"""

from __future__ import annotations

import os
import random

import torch

from seqpar.data import pack_documents
from seqpar.errors import SeqparInputError

__all__ = ["FileRows", "load_tokenizer"]

_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_tokenizer(path: str | None) -> object:
    """A tokenizer from a local directory (transformers ``AutoTokenizer``), or the byte tokenizer for None."""
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


class FileRows:
    """Packed rows of local data files; ``batch(step, micro, size)`` is deterministic in the seed."""

    def __init__(self, files: list[str], tokenizer, seq_len: int, text_field: str, seed: int) -> None:
        kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
        if None in kinds or len(kinds) != 1:
            raise SeqparInputError(
                f"data files must all be of one kind among {sorted(_BUILDERS)}; got {', '.join(files)}"
            )
        import datasets

        datasets.disable_progress_bars()
        try:
            table = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
        except Exception as error:
            raise SeqparInputError(
                f"cannot read data files {', '.join(files)}: {str(error).splitlines()[0]}"
            ) from error
        if text_field not in table.column_names:
            raise SeqparInputError(
                f"data has no column {text_field!r} (columns: {table.column_names}); set --text-field"
            )
        eos = getattr(tokenizer, "eos_token_id", None)
        docs = []
        for text in table[text_field]:
            if text:
                ids = _encode(tokenizer, str(text))
                docs.append(ids + ([eos] if eos is not None else []))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.rows = pack_documents(docs, seq_len, pad_token_id=pad if pad is not None else 0)
        if not self.rows:
            raise SeqparInputError(f"no text found in {', '.join(files)}")
        self.seed = seed

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows for global example indices (epochs reshuffle with the seed)."""
        n = len(self.rows)
        picked = []
        for i in indices:
            epoch, within = divmod(i, n)
            order = list(range(n))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            picked.append(self.rows[order[within]])
        return {key: torch.stack([r[key] for r in picked]) for key in ("input_ids", "position_ids", "attention_mask")}
