"""Adapters to other libraries through their documented extension points: transformers' attention interface,
torch's experimental ``context_parallel`` (with its SDPA mode and autograd glue), transformers' MoE router loss,
diffusers transformers through module hooks (``prepare_diffusers``).
"""

from seqpar.integrations.diffusion import check_replicated, prepare_diffusers
from seqpar.integrations.moe import router_aux_loss
from seqpar.sequence_parallel.prepare import prepare_model

__all__ = ["check_replicated", "prepare_diffusers", "prepare_model", "router_aux_loss"]
