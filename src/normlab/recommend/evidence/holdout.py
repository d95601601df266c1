"""The ladder's projection checked against a run it did not see: a finished recommendation's user placement and
its rival trained one rung beyond its ladder (`WIDTH_MULT` x its widest width, `TOKEN_MULT` x that rung's
tokens; muP from the proxy, each at its best learning rate, the final round's seeds), the effective speedup
measured there (`speedup.for_pair`, with the recommendation's own norm tax), the ladder's fit
(`ladder.fit`) evaluated at the held-out rung's compute, and whether the measurement falls inside the
projection's prediction interval (docs/results.md, "Speedup projections"; `scripts/speedup_holdout.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normlab.errors import ConfigError
from normlab.experiments.runner import run_sweep
from normlab.io import own_folder, read_json
from normlab.model.config import ModelConfig
from normlab.recommend.evidence import ladder, speedup
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.planning.inputs import proxy_settings, proxy_sweep
from normlab.recommend.planning.plan_record import Plan
from normlab.recommend.planning.shape import UserModel
from normlab.recommend.stages.records import Recommendation
from normlab.runs.files import RecommendDir

WIDTH_MULT = 2
TOKEN_MULT = 4


def _read(rec: Path) -> tuple[Recommendation, Plan, dict[str, Any]]:
    """The recommendation in `rec`, its plan and plan.json's inputs; one line where a file lacks a key the records
    need (a folder an older normlab wrote)."""
    folder = RecommendDir(rec)
    if not folder.json_file.is_file() or not folder.plan_file.is_file():
        raise ConfigError(f"{rec} holds no finished recommendation (recommendation.json and plan.json)")
    saved = read_json(folder.plan_file)
    try:
        return Recommendation.from_json(read_json(folder.json_file)), Plan.from_json(saved["plan"]), saved["inputs"]
    except KeyError as err:
        raise ConfigError(
            f"{rec}'s recommendation.json or plan.json lacks {err.args[0]!r}: give a folder a finished "
            "`normlab recommend --ladder ...` of this version wrote"
        ) from None


def holdout(rec: Path, out: Path, workers: int = 2, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train the held-out rung of the recommendation in `rec` into `out` (a new folder; resumed when run again)
    and compare the measured speedup there with the ladder's projection (module doc)."""
    result, plan, inputs = _read(rec)
    sp = result.effect.get("speedup") or {}
    rungs = [r for r in sp.get("by_scale") or [] if r.get("compute")]
    if not plan.ladder or len(rungs) < 3:
        raise ConfigError(f"{rec}'s recommendation has no ladder of three rungs to project from")
    ranking = {r["layout"]: r for r in result.ranking}
    base, cand = ranking[sp["baseline"]], ranking[sp["candidate"]]
    widest = max(rungs, key=lambda r: r["width"])
    width = WIDTH_MULT * widest["width"]
    steps = TOKEN_MULT * (int(plan.ladder.steps.get(str(widest["width"]), plan.steps)))
    user = UserModel(ModelConfig(**inputs["model"]), source=str(rec))
    at_proxy = proxy_settings(user, plan.depth, result.precision, {}, plan.optimizer)
    extra = {k: v for k, v in inputs["base"].items() if at_proxy.get(k) != v}  # the user's own --set
    settings = proxy_settings(user, plan.depth, result.precision, extra, plan.optimizer, width=width)
    settings["steps"] = steps
    root = own_folder(out, "sweep")
    log(
        f"held-out rung: {base['layout']} and {cand['layout']} at width {width} ({WIDTH_MULT}x the ladder's widest), "
        f"{steps} steps ({TOKEN_MULT}x its tokens), seeds {plan.seeds}"
    )
    groups: dict[float, list[str]] = {}
    for r in (base, cand):
        groups.setdefault(float(r["best_lr"]), []).append(r["layout"])
    for lr, names in groups.items():
        path = root / f"w{width}-lr{lr:g}"
        run_sweep(
            proxy_sweep(settings, names, [lr], list(plan.seeds), name=f"holdout-w{width}"), path, workers, log=log
        )
    runs = speedup.gathered([root / f"w{width}-lr{lr:g}" for lr in groups])
    if runs is None:
        raise ConfigError(f"no store in {root}: the held-out rung did not run")
    ev = {
        n: Evidence(n, "", "", finished=int((runs.layout == n).sum()), best_lr=float(ranking[n]["best_lr"]))
        for n in (base["layout"], cand["layout"])
    }
    measured = speedup.for_pair(runs, root, ev[base["layout"]], ev[cand["layout"]], sp.get("tax"), width, plan.depth)
    compute = speedup.cell_compute(runs, root, base["layout"], float(base["best_lr"]))
    if compute is None:
        raise ConfigError(f"no finished run of {base['layout']} at the held-out rung: nothing to compare")
    proj = ladder.fit(rungs, compute)
    value, iv = measured.get("value"), proj.get("interval")
    inside = None if value is None or iv is None else bool(iv[0] <= value <= iv[1])
    record = {
        "recommendation": str(rec),
        "baseline": base["layout"],
        "candidate": cand["layout"],
        "names": [base.get("short") or base["layout"], cand.get("short") or cand["layout"]],
        "precision": result.precision,
        "optimizer": plan.optimizer,
        "ladder": [r["width"] for r in rungs],
        "heldout": {
            "width": width,
            "steps": steps,
            "compute": compute,
            "tokens": measured["by_scale"][0]["tokens"] if measured.get("by_scale") else None,
        },
        "measured": {"value": value, "interval": measured.get("interval"), "seeds": measured.get("seeds")},
        "projected": {"value": proj.get("value"), "interval": iv, "trend": proj.get("trend")},
        "rungs": [{k: r.get(k) for k in ("width", "compute", "value", "interval")} for r in rungs],
        "inside": inside,
    }
    (root / "holdout.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def words(rec: dict[str, Any]) -> str:
    """One line: the comparison, the projection, the measurement, inside or not."""
    m, p = rec["measured"], rec["projected"]
    proj = (
        f"projected x{p['value']:.2f} [{p['interval'][0]:.2f}, {p['interval'][1]:.2f}]"
        if p.get("interval") is not None
        else "no projection"
    )
    got = f"measured x{m['value']:.2f}" if m.get("value") is not None else "no measurement"
    if m.get("interval"):
        got += f" [{m['interval'][0]:.2f}, {m['interval'][1]:.2f}]"
    verdict = {True: "inside", False: "OUTSIDE", None: "not comparable"}[rec["inside"]]
    return (
        f"{' -> '.join(rec.get('names') or [rec['baseline'], rec['candidate']])} ({rec['precision']}, "
        f"{rec['optimizer']}), ladder "
        f"{'/'.join(str(w) for w in rec['ladder'])} -> held-out d {rec['heldout']['width']}: {proj}; {got}: {verdict}"
    )
