"""`normlab recommend`: a placement for the user's own model, with the evidence behind it, in five rooms.

- `planning`: the user's model (`shape`), what is asked (`inputs`), candidates as changes to the user's placement
  (`derived`), how the time budget is spent (`plan`, its record `plan_record`) and what each stage costs on this
  machine (`cost`);
- `stages`: what the stages share (`context`), the typed records (`records`), the named stages (`screen`, `rounds`,
  `ladder`, `verify`, `conclude` with its `speedup_gate`) and the command itself, resumable (`pipeline`);
- `evidence`: each candidate's row and the ranking rule (`rows`, `rank`, `signals`), the recipes' verdicts
  (`agreement`), the answer sized to its evidence (`answer`), the effective speedup (`speedup`), the norm tax
  (`tax`), the ladder and its held-out check (`ladder`, `holdout`), the gate (`gate`);
- `report`: the recommendation in words and as a page (`explain`, `ranking_figure`);
- `frameworks`: the winner's settings in normlab, transformers, OLMo-core, torchtitan and litgpt (`snippets`,
  `settings`, `patches`);
- `cli_command`: `normlab recommend` as the CLI calls it.
"""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "recommend": "normlab.recommend.stages.pipeline",
        "read_user_model": "normlab.recommend.planning.shape",
        "UserModel": "normlab.recommend.planning.shape",
        "settings_for": "normlab.recommend.frameworks.snippets",
    },
    globals(),
)

__all__ = ["UserModel", "read_user_model", "recommend", "settings_for"]
