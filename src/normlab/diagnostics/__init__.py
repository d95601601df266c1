"""Diagnostics: the papers' measurements of hidden states and gradients, recorded during training."""

from normlab.diagnostics.probes import Probes
from normlab.diagnostics.store import Run, load_run

__all__ = ["Probes", "Run", "load_run"]
