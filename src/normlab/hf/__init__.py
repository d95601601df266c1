"""The Hugging Face side: exact conversions to and from transformers' own classes (one adapter per
architecture in `normlab.hf.archs`), the normlab class for any layout, and `scan`.

transformers is optional (`pip install normlab[hf]`); nothing here imports it until used.
"""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "from_hf": "normlab.hf.export", "save_hf": "normlab.hf.export", "to_hf": "normlab.hf.export",
    "ARCHS": "normlab.hf.native", "NativeExportError": "normlab.hf.native", "from_native": "normlab.hf.native",
    "save_native": "normlab.hf.native", "to_native": "normlab.hf.native",
}, globals())

__all__ = ["ARCHS", "NativeExportError", "from_hf", "from_native", "save_hf", "save_native", "to_hf", "to_native"]
