"""A seqpar-prepared transformers model run on whole sequences with its own attention, for a while (generation).

RL trainers sample completions with ``model.generate`` on one rank per sequence-parallel group; this is how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.prepare import ORIGINAL_ATTENTION_ATTR, PREPARED_ATTENTION_ATTR, UNSHARDED_ATTR


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside: ``model`` runs the attention it had before ``seqpar.prepare_model`` on whole sequences.

    seqpar's forward hooks stand aside (no check, no collective), so one rank alone may call the model, e.g.
    ``model.generate``: tokens, masks, KV cache and position ids are the model's own, as before preparation.
    On leaving, seqpar's attention is back (also after an exception).

    Args:
        model: a model returned by ``seqpar.prepare_model`` (or one it was never applied to: nothing changes).

    Yields:
        The same model.

    Raises:
        SeqparInputError: when nested (the model is already unsharded).
    """
    if getattr(model, UNSHARDED_ATTR, False):
        raise SeqparInputError("seqpar.integrations.unsharded(model) cannot be nested for one model")
    original = getattr(model, ORIGINAL_ATTENTION_ATTR, None)
    prepared = getattr(model, PREPARED_ATTENTION_ATTR, None)  # seqpar's for the text decoder, others' own
    if original is None or prepared is None:
        yield model  # not prepared by seqpar: already its own attention
        return
    setattr(model, UNSHARDED_ATTR, True)
    model.set_attn_implementation(original)
    try:
        yield model
    finally:
        model.set_attn_implementation(prepared)
        setattr(model, UNSHARDED_ATTR, False)
