"""Input checks that fail the same way on every rank, before any collective can hang.

``agreement`` exchanges named signatures between ranks (Note [agreeing on errors]); ``attention`` holds the
rules for ``seqpar.attention``'s inputs.
"""

from seqpar.sequence_parallel.checks.agreement import (
    Signature,
    by_rank,
    config_digest,
    config_disagreement,
    exchange_signatures,
)
from seqpar.sequence_parallel.checks.attention import (
    SIGNATURE_LENGTH,
    check_attention_inputs,
)

__all__ = [
    "SIGNATURE_LENGTH",
    "Signature",
    "by_rank",
    "check_attention_inputs",
    "config_digest",
    "config_disagreement",
    "exchange_signatures",
]
