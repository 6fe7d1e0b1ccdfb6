"""Integrations with other libraries through their documented extension points."""

from seqpar.integrations.moe import router_aux_loss
from seqpar.integrations.pipeline_parallel import PipelineParallel, apply_pipeline_parallel
from seqpar.integrations.transformers import prepare_model

__all__ = ["PipelineParallel", "apply_pipeline_parallel", "prepare_model", "router_aux_loss"]
