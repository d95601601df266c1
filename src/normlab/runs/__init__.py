"""Runs on disk: the run directory and sweep folder (their files, outcomes, checkpoints, start and
lock), the sweep store, and the one function that builds a run's model for training, export and
evaluation."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "RunDir": "normlab.runs.files",
        "SweepDir": "normlab.runs.files",
        "SweepStore": "normlab.runs.store",
        "describe": "normlab.runs.outcome",
        "build_run_model": "normlab.runs.model",
        "load_run_model": "normlab.runs.model",
    },
    globals(),
)

__all__ = ["RunDir", "SweepDir", "SweepStore", "build_run_model", "describe", "load_run_model"]
