"""The Hugging Face side: exact conversions to and from transformers' own classes, and `scan`.

transformers is optional (`pip install normlab[hf]`); nothing here imports it until used.
"""

from normlab.hf.export import from_hf, save_hf, to_hf
from normlab.hf.native import ARCHS, NativeExportError, from_native, save_native, to_native

__all__ = ["ARCHS", "NativeExportError", "from_hf", "from_native", "save_hf", "save_native", "to_hf", "to_native"]
