"""`normlab recommend`: a placement for the user's own model, with the evidence behind it.

- `shape`: the user's model (size preset, TOML, transformers config.json) and the shapes derived from it;
- `plan`: how the time budget is spent (screen width, proxy depth, rounds, learning rates, seeds);
- `rank`: the evidence table and the ranking rule;
- `agreement`: the recipes' verdicts a ranking is checked against;
- `frameworks`: the winner's settings in normlab, transformers, OLMo-core, torchtitan and litgpt;
- `explain`: the recommendation in words and as a page (reason, evidence table, checks, settings, limits);
- `records`: the typed records (stage record, final round, recommendation), JSON only at the folder;
- `inputs`: what is asked, checked before anything runs; the proxies' settings and sweeps;
- `context`: what the stages share (folder, budget clock, workers, log, sweep executor, plan, findings);
- `stage_screen`, `stage_rounds`, `stage_verify`, `stage_conclude`: the named stages;
- `stages`: the command itself (the stages in order), resumable;
- `cli_command`: `normlab recommend` as the CLI calls it.
"""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "recommend": "normlab.recommend.stages",
        "read_user_model": "normlab.recommend.shape",
        "UserModel": "normlab.recommend.shape",
        "settings_for": "normlab.recommend.frameworks",
    },
    globals(),
)

__all__ = ["UserModel", "read_user_model", "recommend", "settings_for"]
