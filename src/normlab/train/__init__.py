"""Training: config, optimizer and schedule, divergence monitor, checkpoints, distributed, the loop."""

from normlab.train.config import TrainConfig
from normlab.train.trainer import TrainingFailed, train

__all__ = ["TrainConfig", "TrainingFailed", "train"]
