"""TRL's ``SFTTrainer`` with the sequence split over ranks (needs ``trl``: ``pip install "seqpar[hf]"``).

Packing (``packing=True``, best-fit decreasing) and ``padding_free=True`` keep every document apart: TRL's
collator gives position ids that restart at each document, and seqpar's attention reads documents from them.
"""

from __future__ import annotations

from trl import SFTTrainer

from seqpar.hf.config import check_sft_arguments
from seqpar.hf.trainer import SequenceParallelMixin

__all__ = ["SequenceParallelSFTTrainer"]


class SequenceParallelSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """``trl.SFTTrainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts sequences (or packed rows) per data-parallel replica: the
    ``sp_size`` ranks of a group share them. The loss is the exact token-mean negative log-likelihood of
    the whole optimizer step (completion-only and assistant-only masks are honoured through the labels).
    TRL's per-token metrics (entropy, token accuracy) are not logged under seqpar.

    Raises:
        SeqparInputError: on every rank, for ``SFTConfig`` options seqpar cannot honour (see
            ``seqpar.hf.config.check_sft_arguments``) and those of the plain Trainer.
    """

    def __init__(self, *args, **kwargs) -> None:
        check_sft_arguments(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
