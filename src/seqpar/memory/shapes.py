"""Old home of a model's sizes: ``ModelDims`` and ``model_dims`` now live in ``seqpar.models`` as ``ModelSizes``.

Kept so that old imports work: ``ModelDims`` is ``ModelSizes``, ``model_dims(config, tp)`` is its ``from_config``.
"""

from __future__ import annotations

from seqpar.models.sizes import ModelSizes, active_parameters, parameter_counts

__all__ = ["ModelDims", "active_parameters", "model_dims", "parameter_counts"]

ModelDims = ModelSizes
"""Alias of ``seqpar.models.ModelSizes`` (its fields carry the config's names; widths of one tp rank are
``q_width``, ``kv_width``, ``mlp_width``, ``dense_width``, ``expert_width`` and ``shared_width``)."""


def model_dims(model_config: object, tp: int) -> ModelSizes:
    """``ModelSizes.from_config(model_config, tp)`` (the old name).

    Args:
        model_config: a transformers config or a dict of its fields.
        tp: tensor-parallel degree.

    Returns:
        The ``ModelSizes``.

    Raises:
        SeqparInputError: as ``ModelSizes.from_config``.
    """
    return ModelSizes.from_config(model_config, tp)
