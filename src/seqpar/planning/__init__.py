"""Planning a run: which dp / sp / ulysses / tp degrees, strategy and memory features fit and train fastest.

``plan(model, seq_len, Cluster(...))`` ranks every valid layout by predicted tokens/s per device.
"""

from seqpar.models import ModelSizes
from seqpar.planning.cluster import Calibration, Cluster, load_calibration, save_calibration
from seqpar.planning.limits import max_seq_len
from seqpar.planning.models import PRESETS, ModelShape, load_model_shape
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
    "ModelShape",
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
