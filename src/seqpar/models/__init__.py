"""Model families: one registry of where each transformers family keeps its parts, and one ``ModelSizes``.

Every axis (sequence, data, tensor and pipeline parallel, the memory features, the doctor) finds a model's
parts through ``anatomy(model)``; the memory estimate and the planner read sizes through ``ModelSizes``;
``DIFFUSION_PLANS`` says where each diffusers transformer is sharded (``seqpar.prepare_diffusers``).
"""

from seqpar.models.anatomy import ModelAnatomy, anatomy, family_of, find_anatomy
from seqpar.models.diffusion import DIFFUSION_PLANS, DiffusionPlan, Gather, JointSplit, Split, register_diffusion_plan
from seqpar.models.families import FAMILIES, LLAMA_TP_PLAN, Family, register_family
from seqpar.models.sizes import ModelSizes, active_parameters, parameter_counts

__all__ = [
    "DIFFUSION_PLANS",
    "FAMILIES",
    "LLAMA_TP_PLAN",
    "DiffusionPlan",
    "Family",
    "Gather",
    "JointSplit",
    "ModelAnatomy",
    "ModelSizes",
    "Split",
    "active_parameters",
    "anatomy",
    "family_of",
    "find_anatomy",
    "parameter_counts",
    "register_diffusion_plan",
    "register_family",
]
