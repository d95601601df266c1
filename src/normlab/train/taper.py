"""TaperNorm's schedule as a step hook: the trainer's step sets the model's one gate (Kanavalau et al. 2026,
arXiv 2602.10408; `normlab.model.norms.TaperNorm`).

Before each step the hook sets every TaperNorm's gate to `taper_gate` (1 during the gate warmup, a half cosine to
0 over the taper, 0 after) and, at the first step whose gate is below 1, calibrates each module's scaling branch
from the statistics it kept while the gate was 1. The step is the trainer's, so a resumed run takes up the schedule
where it stopped (the calibration and the statistics are buffers, saved with the weights).
"""

from __future__ import annotations

from torch import nn

from normlab.diagnostics.hooks import StepHook
from normlab.model.norms import TaperNorm, taper_gate


class TaperHook(StepHook):
    """Sets ``norms``' gate for step ``step`` of ``steps`` before the step, calibrating them when the taper starts."""

    priority = 40  # before the probe pass: the probes see the step's own gate

    def __init__(self, norms: list[TaperNorm], steps: int) -> None:
        self.norms, self.steps = norms, steps

    @classmethod
    def for_model(cls, model: nn.Module, steps: int) -> TaperHook | None:
        """The hook for ``model``'s TaperNorms (None: it holds none)."""
        norms = [m for m in model.modules() if isinstance(m, TaperNorm)]
        return cls(norms, steps) if norms else None

    def gate(self, step: int) -> float:
        return taper_gate(step, self.steps, TaperNorm.START, TaperNorm.END)

    def pre_step(self, step: int) -> None:
        g = self.gate(step)
        for norm in self.norms:
            if g < 1.0 and not norm.is_calibrated:
                norm.calibrate()
            norm.set_gate(g)
