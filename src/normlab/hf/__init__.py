"""The Hugging Face side: exact conversions to and from transformers' own classes (one adapter per
architecture in `normlab.hf.archs`), the normlab class for any layout, `scan`, and `NormlabCallback`
(normlab's probes inside a transformers Trainer run).

transformers is optional (`pip install normlab[hf]`); nothing here imports it until used.
"""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "from_hf": "normlab.hf.export",
        "save_hf": "normlab.hf.export",
        "to_hf": "normlab.hf.export",
        "ARCHS": "normlab.hf.native",
        "NativeExportError": "normlab.hf.native",
        "from_native": "normlab.hf.native",
        "save_native": "normlab.hf.native",
        "to_native": "normlab.hf.native",
        "NormlabCallback": "normlab.hf.callback",
    },
    globals(),
)

__all__ = [
    "ARCHS",
    "NativeExportError",
    "NormlabCallback",
    "from_hf",
    "from_native",
    "save_hf",
    "save_native",
    "to_hf",
    "to_native",
]
