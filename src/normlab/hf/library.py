"""transformers, imported where normlab needs it: the module, or one line saying how to install it.

normlab's core never imports transformers (tests/integration/test_hf.py checks); the hf/ modules that need it
ask here, so that the message is one and the same everywhere.
"""

from __future__ import annotations

from typing import Any

from normlab.errors import ConfigError


def require_transformers() -> Any:
    """The transformers module, or a ConfigError with the install command."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("this needs transformers: pip install normlab[hf] (or pip install transformers)") from None
    return transformers
