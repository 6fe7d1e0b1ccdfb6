"""Model families: one registry of where each transformers family keeps its parts, and one ``ModelSizes``.

Every axis (sequence, data, tensor and pipeline parallel, the memory features, the doctor) finds a model's
parts through ``anatomy(model)``; the memory estimate and the planner read sizes through ``ModelSizes``.
"""

from seqpar.models.anatomy import ModelAnatomy, anatomy, family_of, find_anatomy
from seqpar.models.families import FAMILIES, LLAMA_TP_PLAN, Family, register_family
from seqpar.models.sizes import ModelSizes, active_parameters, parameter_counts

__all__ = [
    "FAMILIES",
    "LLAMA_TP_PLAN",
    "Family",
    "ModelAnatomy",
    "ModelSizes",
    "active_parameters",
    "anatomy",
    "family_of",
    "find_anatomy",
    "parameter_counts",
    "register_family",
]
