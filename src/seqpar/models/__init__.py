"""Model families: one registry of where each transformers family keeps its parts, and one ``ModelSizes``.

Every axis (sequence, data, tensor and pipeline parallel, the memory features, the doctor) finds a model's
parts through ``anatomy(model)``; the memory estimate and the planner read sizes through ``ModelSizes``;
``MIXER_KINDS`` holds one row per token mixer other than attention (Note [mixer rows]); ``DIFFUSION_PLANS`` says
where each diffusers transformer is sharded (``seqpar.prepare_diffusers``), ``DIFFUSION_ATTENTION`` what an
attention class does that its names cannot tell.
"""

from seqpar.models.anatomy import ModelAnatomy, anatomy, find_anatomy
from seqpar.models.diffusion import DIFFUSION_PLANS, Split, register_diffusion_plan
from seqpar.models.diffusion_attention import DIFFUSION_ATTENTION, AttentionRow, register_attention_row
from seqpar.models.families import FAMILIES, LLAMA_TP_PLAN, Family, register_family
from seqpar.models.hybrid_sizes import Hybrid
from seqpar.models.mixers import MIXER_KINDS, MixerSizes, register_mixer_kind
from seqpar.models.sizes import ModelSizes, active_parameters, parameter_counts

__all__ = [
    "DIFFUSION_ATTENTION",
    "DIFFUSION_PLANS",
    "FAMILIES",
    "LLAMA_TP_PLAN",
    "MIXER_KINDS",
    "AttentionRow",
    "Family",
    "Hybrid",
    "MixerSizes",
    "ModelAnatomy",
    "ModelSizes",
    "Split",
    "active_parameters",
    "anatomy",
    "find_anatomy",
    "parameter_counts",
    "register_attention_row",
    "register_diffusion_plan",
    "register_family",
    "register_mixer_kind",
]
