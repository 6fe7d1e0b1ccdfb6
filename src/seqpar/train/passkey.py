"""Passkey retrieval: a number hidden early in a long filler document, asked for at its end.

Only attention over the whole sequence can answer it, so it exercises sequence parallelism end to end.

Note [passkey task]
    A document is filler sentences with one "The pass key is #NNNNN#. Remember it." placed in its first
    quarter, and it ends with " What is the pass key? #NNNNN.". The model is trained as a language model
    on whole documents (filler is cheap to learn, so the loss falls quickly). Answering needs a head that
    finds the earlier "#" (it never occurs in the filler) and copies the digits after it across the whole
    sequence, an induction-style lookup that small models learn late; the evaluation says honestly how far
    a run got. It is teacher-forced: a key counts as retrieved when the most likely next token is right at
    each of its digits. Examples are generated from (seed, split, length, index), so a run and its resumed
    continuation see the same data.
"""

from __future__ import annotations

import random

import torch

from seqpar.errors import SeqparInputError
from seqpar.train.tokenizer import ByteTokenizer

__all__ = ["DIGITS", "PasskeyTask"]

DIGITS = 5
_FILLER = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)
_QUESTION = " What is the pass key? #"


class PasskeyTask:
    """Deterministic passkey documents of an exact token length (Note [passkey task])."""

    def __init__(self, tokenizer: ByteTokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.seed = seed

    def example(self, seq_len: int, index: int, split: str = "train") -> tuple[list[int], list[int]]:
        """Tokens of document ``index`` and the positions of its answer digits (to be predicted).

        Raises:
            SeqparInputError: ``seq_len`` too short to hold the key and the questions.
        """
        rng = random.Random(f"{self.seed}-{split}-{seq_len}-{index}")
        key = "".join(rng.choice("0123456789") for _ in range(DIGITS))
        needle = self.tokenizer.encode(f"The pass key is #{key}#. Remember it. ")
        question = self.tokenizer.encode(_QUESTION)
        tail = self.tokenizer.encode(_QUESTION + key + ".")
        room = seq_len - len(needle) - len(tail)
        if room < 8:
            raise SeqparInputError(
                f"sequence length {seq_len} is too short for the passkey task (needs at least {seq_len - room + 8})"
            )
        sentences: list[list[int]] = []
        while sum(map(len, sentences)) < room:
            sentences.append(self.tokenizer.encode(rng.choice(_FILLER)))
        at = rng.randrange(0, max(1, len(sentences) // 4))  # a sentence boundary in the first quarter
        filler = [t for s in sentences[:at] for t in s] + needle + [t for s in sentences[at:] for t in s]
        ids = filler[: seq_len - len(tail)] + tail
        first = seq_len - len(tail) + len(question)
        answer = list(range(first, first + DIGITS))
        return ids, answer

    def batch(self, seq_len: int, indices: list[int], split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` ``[B, seq_len]`` and the answer positions ``[B, DIGITS]``."""
        pairs = [self.example(seq_len, i, split) for i in indices]
        return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
