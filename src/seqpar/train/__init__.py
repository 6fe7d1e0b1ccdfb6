"""``seqpar train``: the trainer behind the command line (config, data, loop, checkpoints, metrics)."""

from seqpar.train.config import TrainConfig

__all__ = ["TrainConfig"]
