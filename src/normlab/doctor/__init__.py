"""`normlab doctor MODEL`: a stability check of trained weights, and an fp16-safe rescaled copy where exact.

`checkup.py` runs one forward and backward on sample text and turns the measurements into findings, each
with the threshold it used; `rescale.py` scales the residual stream of a layout whose every reader is a
scale-invariant norm, so that the logits are unchanged and the activations fit fp16.
"""

from normlab.doctor.checkup import Finding, checkup, load_model, sample_tokens, write_copy
from normlab.doctor.rescale import Rescale, rescalable, rescale_for_fp16

__all__ = [
    "Finding",
    "Rescale",
    "checkup",
    "load_model",
    "rescalable",
    "rescale_for_fp16",
    "sample_tokens",
    "write_copy",
]
