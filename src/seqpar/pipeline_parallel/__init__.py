"""Pipeline parallel: a causal LM's decoder layers cut into stages over the mesh's "pp" axis.

Collectives: point-to-point sends and receives of activations and their gradients between neighbouring stages
(torch.distributed.pipelining's schedules), an all-reduce of a tied embedding's gradient between the first and
last stage, an all-reduce over pp for the gradient norm, and one over pp x dp x sp for the step's loss
(Note [pipeline loss]).

Pipeline code elsewhere, and why: ``seqpar.memory.pipeline`` is the analytic memory and time model of a
pipeline (Note [pipeline memory and time]): plain arithmetic that the memory estimate, a layer below this
package, and the planner read without loading torch's pipelining. ``seqpar.train.pipeline`` and
``seqpar.train.pipeline_config`` are ``seqpar train``'s glue (its --pp flags, checkpoints and evaluation;
Note [pipeline in seqpar train]).
"""

from seqpar.pipeline_parallel.runner import SCHEDULES, PipelineParallel, apply_pipeline_parallel

__all__ = ["SCHEDULES", "PipelineParallel", "apply_pipeline_parallel"]
