"""Integrations with other libraries through their documented extension points."""

from seqpar.integrations.transformers import prepare_model

__all__ = ["prepare_model"]
