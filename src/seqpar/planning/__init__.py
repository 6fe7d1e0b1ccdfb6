"""Planning a run: which dp / sp / ulysses / tp degrees, strategy and memory features fit and train fastest.

``plan(model, seq_len, Cluster(...))`` ranks every valid layout by predicted tokens/s per device.
"""

# Note [torch-free planning]
#     Planning is arithmetic on sizes, so ``seqpar plan`` (and ``import seqpar.planning; plan(...)``) loads no
#     torch: importing torch costs a second or more of a planning run. What the planner reads from the lower
#     layers (ParallelDims in seqpar.mesh, the strategy rows, select_strategy without a mask, the memory estimate
#     and its dtype table, the models' sizes, reduce_gradients' bucket size) lives in modules that import torch
#     only inside the functions that touch tensors, process groups or modules, or under TYPE_CHECKING for
#     hints; package faces on the way (seqpar.memory, the strategies package) import their torch modules on
#     first use, a strategy row imports its function on first use, and ``--calibrate`` imports the calibration.
#     tests/test_imports.py runs the planner in a fresh interpreter and checks that torch stays out.

from seqpar.models import ModelSizes
from seqpar.planning.cluster import Calibration, Cluster, load_calibration, save_calibration
from seqpar.planning.limits import max_seq_len
from seqpar.planning.models import PRESETS, load_model_shape
from seqpar.planning.report import format_plan, plan_to_dict
from seqpar.planning.search import Candidate, Plan, Rejection, plan
from seqpar.planning.timing import FEATURES, OFFLOAD_OPTIMIZER, Layout, StepTime, model_flops, step_time

__all__ = [
    "FEATURES",
    "OFFLOAD_OPTIMIZER",
    "PRESETS",
    "Calibration",
    "Candidate",
    "Cluster",
    "Layout",
    "ModelSizes",
    "Plan",
    "Rejection",
    "StepTime",
    "format_plan",
    "load_calibration",
    "load_model_shape",
    "max_seq_len",
    "model_flops",
    "plan",
    "plan_to_dict",
    "save_calibration",
    "step_time",
]
