"""A byte-level tokenizer: every UTF-8 byte is a token, plus padding and end-of-document tokens.

Nothing to download; the embedded demo and plain-text data without a model tokenizer use it.
"""

from __future__ import annotations


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; ``pad_token_id`` = 256, ``eos_token_id`` = 257."""

    pad_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped and invalid bytes replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
