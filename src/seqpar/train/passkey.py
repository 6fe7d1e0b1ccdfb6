"""Pass-key recitation: blocks of random letters, each followed by its exact repetition.

At the default length and 2 or 4 ranks, every repeated letter sits on another rank than the letter it repeats.

Note [passkey task]
    An example of L tokens is pass keys and their recitations: BLOCK random lowercase letters (the key),
    then the same BLOCK letters again, then a new key and its recitation, and so on, cut at L tokens. The
    model is trained as a language model on every token. A key's letters are random (nothing predicts
    them), but each recited letter is exactly the letter BLOCK positions earlier. The scored answers are
    the recited letters but the first of each recitation (that one is predicted at the key's last letter,
    where the key's rank already holds it); a guess is right 1 time in 26 (``CHANCE``). A two-layer model learns the
    lookup within about a hundred steps: a head that attends BLOCK - 1 positions back and copies the
    letter there (the rotary position encoding makes a fixed relative offset easy to attend to).

    Why the answers need attention across ranks: under the zigzag layout with sp ranks the sequence is cut
    into 2 sp chunks and rank r holds chunks r and 2 sp - 1 - r (Note [zigzag layout]). At the default
    512 tokens and sp 2 the chunks are the four blocks: rank 0 holds the first key and the last recitation,
    rank 1 the first recitation and the second key. A scored letter at position p is predicted at p - 1,
    in its recitation, from the letter at p - BLOCK, in the key: always the other rank, and nothing on the
    predicting rank helps (letters are drawn afresh for every example). At sp 4 (chunks of 64) the keys'
    chunks 0, 1, 4, 5 are on ranks 0, 1, 3, 2 and the recitations' chunks 2, 3, 6, 7 on ranks 2, 3, 1, 0,
    again never the same rank (a test checks both). Longer sequences keep BLOCK, so the distance stays the
    one trained on, but a recitation then often lies on its key's rank: evaluating at twice the trained
    length measures lengths never trained on, not the separation.

    Determinism: every example comes from ``random.Random(f"{seed}-{split}-{seq_len}-{index}")`` and nothing
    else, so any rank, any layout and a resumed run see the same tokens for the same example; the training
    ("train") and evaluation ("eval") streams are distinct.
"""

from __future__ import annotations

import random

import torch

from seqpar.errors import SeqparInputError
from seqpar.train.tokenizer import ByteTokenizer

TASK = "pass-key recitation"
BLOCK = 128
"""Letters in a pass key (and so the distance from a letter to its repetition)."""
LETTERS = bytes(range(ord("a"), ord("z") + 1))
CHANCE = 1 / len(LETTERS)
"""Accuracy of a uniform guess among the letters."""


class PasskeyTask:
    """Deterministic pass-key recitation examples of an exact token length (Note [passkey task])."""

    def __init__(self, tokenizer: ByteTokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.seed = seed

    def example(self, seq_len: int, index: int, split: str = "train") -> tuple[list[int], list[int]]:
        """Tokens of example ``index`` and the positions of its recited letters (the scored answers).

        Args:
            seq_len: tokens in the example.
            index: example number.
            split: "train" or "eval" (distinct streams of examples).

        Returns:
            ``seq_len`` token ids, and the positions of the scored recited letters (each repeats the token
            ``BLOCK`` earlier).

        Raises:
            SeqparInputError: ``seq_len`` too short to hold a key and the start of its recitation.
        """
        if seq_len <= BLOCK:
            raise SeqparInputError(
                f"sequence length {seq_len} is too short for the passkey task (needs more than {BLOCK})"
            )
        rng = random.Random(f"{self.seed}-{split}-{seq_len}-{index}")
        ids: list[int] = []
        while len(ids) < seq_len:
            key = [rng.choice(LETTERS) for _ in range(BLOCK)]
            ids += key + key
        answers = [p for p in range(seq_len) if (p // BLOCK) % 2 == 1 and p % BLOCK]
        return ids[:seq_len], answers

    def batch(self, seq_len: int, indices: list[int], split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` ``[B, seq_len]`` and the scored answer positions ``[B, A]`` (the same in every row).

        Args:
            seq_len: tokens per example.
            indices: example numbers.
            split: "train" or "eval".

        Returns:
            The token ids and the answer positions.
        """
        pairs = [self.example(seq_len, i, split) for i in indices]
        return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
