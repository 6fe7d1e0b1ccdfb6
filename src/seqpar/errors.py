"""Exceptions seqpar raises for bad input, so callers can catch them apart from bugs.

Every message says what was wrong and what would be valid.
"""

from __future__ import annotations


class SeqparInputError(ValueError):
    """Input that seqpar cannot serve correctly; raised on every rank of the group, before any collective."""
