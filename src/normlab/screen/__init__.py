"""Screen a layout before training: Kan et al.'s four-step stability workflow (App. B)."""

from normlab.screen.screen import ScreenConfig, format_table, load_layout_arg, parse_stresses, screen_layout
from normlab.screen.uncertainty import wasserstein2
from normlab.screen.wellposed import wellposedness

__all__ = [
    "ScreenConfig",
    "format_table",
    "load_layout_arg",
    "parse_stresses",
    "screen_layout",
    "wasserstein2",
    "wellposedness",
]
