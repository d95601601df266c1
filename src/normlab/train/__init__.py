"""Training: config, optimizer and schedule, divergence monitor, checkpoints, distributed, the loop."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "TrainConfig": "normlab.config.train",
        "TrainingFailed": "normlab.train.trainer",
        "train": "normlab.train.trainer",
    },
    globals(),
)

__all__ = ["TrainConfig", "TrainingFailed", "train"]
