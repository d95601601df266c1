"""Diagnostics: the papers' measurements of hidden states and gradients, recorded during training."""

from normlab.diagnostics.attach import ProbeSession, StreamProbe, find_blocks, probing
from normlab.diagnostics.probe_store import Run, load_run
from normlab.diagnostics.probes import Probes
from normlab.diagnostics.stability import SpikeRule
from normlab.diagnostics.training_monitor import TrainingMonitor

__all__ = [
    "ProbeSession",
    "Probes",
    "Run",
    "SpikeRule",
    "StreamProbe",
    "TrainingMonitor",
    "find_blocks",
    "load_run",
    "probing",
]
