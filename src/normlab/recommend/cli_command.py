"""`normlab recommend MODEL` as a call: the proxy run settings the user gave checked against what recommend
decides itself, a first line within the first second, then `normlab.recommend.stages.pipeline.recommend` on the user's
model (its own modules imported only then: torch and the rest load after that line)."""

from __future__ import annotations

from typing import Any

from normlab.config.commands import RecommendConfig, check_recommend_settings
from normlab.config.train import typed_settings


def recommend_command(model: str, cfg: RecommendConfig, extra: dict[str, Any], started: float) -> None:
    """Recommend a placement for ``model`` (a size preset, a .toml or a transformers config.json) within
    ``cfg.budget`` minutes counted from ``started``; ``extra``: the proxies' run settings as text (--set, --steps)."""
    check_recommend_settings(extra)
    cfg = cfg.with_quick_defaults()
    print(f"recommend: reading {model} (budget {cfg.budget:g} min)", flush=True)
    from normlab.recommend.planning.shape import read_user_model
    from normlab.recommend.stages.pipeline import recommend

    recommend(read_user_model(model), cfg, typed_settings(extra, "recommend", from_text=True), started=started)
