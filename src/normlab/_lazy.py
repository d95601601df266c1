"""Package attributes imported on first use (PEP 562), so `normlab --help`, `normlab layouts` and
`import normlab.layout` do not pay for torch (about 1.5 s here): a package's ``__init__`` names
where each export lives and imports it when it is first read."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``exports`` maps a name to the module defining it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later reads skip this function
        return value

    return __getattr__
