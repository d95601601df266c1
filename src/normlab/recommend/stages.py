"""`normlab recommend`: a placement for the user's own model, with the evidence behind it, in stages
that fit a time budget, each resumable.

    screen        Kan et al.'s four steps for every candidate at the user's depth (and width, where the
                  budget allows): the verdicts, and what rules a candidate out before training
    stress round  every candidate left, trained once at the stress learning rate with the user's
                  precision stored (fp16: activations past 65504 overflow, as in the papers' Megatron runs)
    final round   the best of the stress round (and the user's current placement) over learning rates x
                  seeds
    ranking       divergences and stalls, best loss, screen verdict, LR sensitivity (`normlab.recommend.rank`),
                  checked against the recipes' verdicts; the winner's settings in five code bases

The folder (`--out`) holds plan.json (the inputs and both rounds' plans: a resumed recommendation reuses
them), screen.json, grid/ (one sweep folder for both rounds: its summary.md and report.html), and
recommendation.md / recommendation.json / report.html. Run the same command again and only what is
missing runs (a changed input is refused: use a new --out).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable

from normlab.config.commands import RECOMMEND_BASE, RecommendConfig
from normlab.errors import ConfigError
from normlab.io import atomic_write_bytes, atomic_write_json, own_folder
from normlab.recommend import agreement, plan, report
from normlab.recommend.frameworks import settings_for
from normlab.recommend.rank import Evidence, baseline_of, evidence_from_grid, rank, ruled_out, screen_summary
from normlab.recommend.shape import PROXY_WIDTH, UserModel, proxy_shape, screen_shape
from normlab.runs.files import RecommendDir

SCREEN_STRESSES = (1.0, 8.0)  # the screen's verdicts compare the lowest and highest stress


def _clock(t0: float, budget_s: float) -> str:
    used = time.time() - t0
    return f"[{used / 60:.1f} of {budget_s / 60:g} min]"


def _candidates(cfg: RecommendConfig, user: UserModel) -> tuple[list[str], str | None]:
    """The candidates (the user's current placement first, under its own name) and that placement's name."""
    from normlab.layout import as_layout

    names = list(dict.fromkeys(cfg.candidates))
    for name in names:
        as_layout(name)  # a typo fails here, with the valid names
    current = None
    if user.layout is not None:
        want = as_layout(user.layout).to_string()
        current = next((n for n in names if as_layout(n).to_string() == want), user.layout)
        names = [current] + [n for n in names if n != current]
    return names, current


def _inputs(user: UserModel, cfg: RecommendConfig, precision: str, base: dict[str, Any],
            candidates: list[str]) -> dict[str, Any]:
    return {"model": user.config.to_dict(), "precision": precision, "candidates": candidates,
            "lrs": list(cfg.lrs), "seeds": list(cfg.seeds), "depth": cfg.depth, "base": base, "proxy": RECOMMEND_BASE}


def _screen(folder: RecommendDir, user: UserModel, candidates: list[str], seconds: float, log: Callable) -> dict[str, Any]:
    """Screen every candidate at the user's depth and the widest width `seconds` affords; resumable."""
    from tqdm import tqdm

    from normlab.config.commands import ScreenConfig
    from normlab.model.params import analytic_params
    from normlab.layout import as_layout
    from normlab.screen.screen import screen_layout

    saved = folder.read(folder.screen_file)
    cfg_of = lambda w: ScreenConfig(size="nano", model=screen_shape(user.config, w, 64), stresses=SCREEN_STRESSES)  # noqa: E731
    width = saved.get("width")
    if width is None:
        widths = sorted({min(user.config.d_model, 64), min(user.config.d_model, 128)})
        screen_layout("pre", ScreenConfig(size="nano", model={"n_layers": 1}, stresses=SCREEN_STRESSES, iters=1))  # warm-up:
        times = {}  # the first screen pays for imports and first calls, which would inflate the prediction
        for w in widths:
            t = time.perf_counter()
            screen_layout("pre", cfg_of(w))
            times[w] = time.perf_counter() - t
        per_width = plan.quadratic(times[widths[0]], widths[0], times[widths[-1]], widths[-1]) \
            if len(widths) > 1 else (lambda w: times[widths[0]])

        def params_at(w: int) -> int:
            from normlab.model.config import ModelConfig

            return analytic_params(ModelConfig(**screen_shape(user.config, w, 64)), as_layout("peri").resolve(
                user.config.n_layers)).total

        width = plan.screen_width(user.config.d_model, per_width, len(candidates), seconds, params_at)
        need = per_width(width) * len(candidates)
        if need > 1.5 * seconds:  # even the narrowest screen would take the proxy runs' time: say so now, not later
            raise ConfigError(f"screening {len(candidates)} candidates at your depth {user.config.n_layers} needs about "
                              f"{need / 60:.1f} min even at width {width}, and the screen has a fifth of the budget "
                              f"({seconds / 60:.1f} min): give --budget {math.ceil(need / plan.SCREEN_SHARE / 60)} or "
                              "more, or fewer --candidates")
        saved = {"width": width, "n_layers": user.config.n_layers, "results": {},
                 "predicted_seconds_each": per_width(width)}
        atomic_write_json(folder.screen_file, saved)
    scaled = "" if width >= user.config.d_model else f" (your {user.config.d_model} scaled down: the screen's time)"
    log(f"screen: {len(candidates)} candidates at your depth {user.config.n_layers} and width {width}{scaled}, "
        f"about {saved['predicted_seconds_each'] * len(candidates) / 60:.1f} min")
    todo = [c for c in candidates if c not in saved["results"]]
    bar = tqdm(total=len(candidates), initial=len(candidates) - len(todo), desc="screen", unit="layout",
               dynamic_ncols=True, disable=None)
    started = time.perf_counter()
    try:
        for i, name in enumerate(todo, 1):
            bar.set_postfix_str(name)
            result = screen_summary(screen_layout(name, cfg_of(width)))
            saved["results"][name] = result
            atomic_write_json(folder.screen_file, saved)  # each result kept the moment it exists
            bar.update(1)
            if bar.disable:  # a log, not a terminal: the bar's ETA as words
                left = len(todo) - i
                eta = (f"; {left} left, ETA {left * (time.perf_counter() - started) / i / 60:.1f} min" if left else "")
                log(f"  screen {name}: {result['verdict']} ({result['seconds']:.1f} s{eta})")
    finally:
        bar.close()
    return saved


def _base(user: UserModel, depth: int, precision: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The proxy runs' settings: the stress settings, the user's block at the proxy shape, their precision
    stored (emulated on a CPU), and the user's own --set on top."""
    from normlab.model.config import SIZES

    ref = SIZES[RECOMMEND_BASE["size"]].to_dict()
    model = {f"model.{k}": v for k, v in proxy_shape(user.config, depth).items() if ref.get(k) != v}
    return {**RECOMMEND_BASE, **model, "activation_dtype": precision, **extra}


def _sweep(base: dict[str, Any], layouts: list[str], lrs: list[float], seeds: list[int]):  # noqa: ANN202
    from normlab.experiments.sweep import SweepConfig

    return SweepConfig(name="recommend", base=base, grid={"layout": layouts, "lr": lrs, "seed": seeds},
                       source="normlab recommend: the proxy grid",
                       scale=f"proxy d {PROXY_WIDTH}, {base.get('model.n_layers', 12)} layers, {base['steps']} steps, "
                             f"{base['activation_dtype']} storage")


def _measured_run_seconds(runs, candidates: list[str], fallback: dict[str, float]) -> dict[str, float]:  # noqa: ANN001
    """Each candidate's run time in the stress round where it trained to the end; else its calibrated
    estimate scaled by how the estimates compared with the measured times."""
    done = runs[runs.status.isin(("ok", "stalled"))]
    measured = {r.layout: float(r.wall_time_s) for r in done.itertuples() if r.wall_time_s and r.layout in fallback}
    ratios = [measured[n] / fallback[n] for n in measured if fallback[n]]
    scale = sorted(ratios)[len(ratios) // 2] if ratios else 1.0
    return {n: measured.get(n, fallback[n] * scale) for n in candidates}


def _stress_order(runs, screen: dict[str, Any], candidates: list[str], lr: float, seed: int) -> list[str]:  # noqa: ANN001
    """The stress round's candidates, best first, from their stress runs only (`runs` may hold the final
    round's too): trained to the end before stalled before diverged; then the lower final loss, or for a
    diverged run the later step it diverged at (its last finite loss says nothing); then the screen's verdict."""
    from normlab.recommend.rank import VERDICT_ORDER

    stress = runs[(runs.lr - lr).abs() <= 1e-9 * lr] if len(runs) else runs
    stress = stress[stress.seed == seed] if len(stress) else stress

    def key(name: str) -> tuple:
        row = stress[stress.layout == name]
        status = row.status.iloc[0] if len(row) else "pending"
        if status == "diverged":
            value = -float(row.step.iloc[0]) if row.step.iloc[0] is not None else 0.0
        else:
            loss = row.final_loss.iloc[0] if len(row) else None
            value = float(loss) if loss is not None and math.isfinite(float(loss)) else math.inf
        return {"ok": 0, "stalled": 1, "diverged": 2}.get(status, 3), value, VERDICT_ORDER.get(screen[name]["verdict"], 3)

    return sorted(candidates, key=key)


def recommend(user: UserModel, cfg: RecommendConfig, extra: dict[str, Any] | None = None,
              log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run the stages within `cfg.budget` minutes; returns the recommendation (also written to the folder)."""
    from normlab.experiments.runner import Deadline, run_sweep
    from normlab.experiments.summary import load_sweep, summarize

    t0 = time.time()
    budget_s = cfg.budget * 60
    end = t0 + budget_s - plan.REPORT_RESERVE_S
    workers = cfg.workers or os.cpu_count() or 1
    precision = cfg.precision or user.precision or "bf16"
    extra = dict(extra or {})
    candidates, current = _candidates(cfg, user)
    root = own_folder(cfg.out, "recommend")
    folder = RecommendDir(root)
    inputs = _inputs(user, cfg, precision, extra, candidates)
    saved = folder.read(folder.plan_file)
    if saved and json.loads(json.dumps(saved.get("inputs"))) != json.loads(json.dumps(inputs)):
        changed = sorted(k for k in inputs if saved["inputs"].get(k) != json.loads(json.dumps(inputs[k])))
        raise ConfigError(f"{root} holds a recommendation for other inputs (changed: {', '.join(changed)}); "
                          "give a new --out")
    saved = saved or {"inputs": inputs}
    calls = saved.setdefault("call_minutes", [])  # each call's time, kept at every stage: a resumed one adds to it
    calls.append(0.0)

    def mark() -> None:
        calls[-1] = (time.time() - t0) / 60
        atomic_write_json(folder.plan_file, saved)

    mark()
    log(f"recommend: {user.describe()}")
    for note in user.notes:
        log(f"  note: {note}")
    log(f"  precision {precision}; {len(candidates)} candidates; budget {cfg.budget:g} min on {workers} worker(s) -> {root}")

    # 1. the screen
    log(f"\n1/3 screen {_clock(t0, budget_s)}")
    screen = _screen(folder, user, candidates, budget_s * plan.SCREEN_SHARE, log)
    mark()
    out_by_screen = {n: why for n in candidates if (why := ruled_out(screen["results"][n], precision))}
    for n, why in out_by_screen.items():
        log(f"  ruled out: {n}: {why}")
    from normlab.recommend.rank import VERDICT_ORDER

    alive = sorted((n for n in candidates if n not in out_by_screen),
                   key=lambda n: (n != current, VERDICT_ORDER.get(screen["results"][n]["verdict"], 3)))
    if not alive:
        raise ConfigError("the screen rules out every candidate (see screen.json); give other --candidates")

    # 2. the stress round
    log(f"\n2/3 stress round {_clock(t0, budget_s)}")
    steps = int(extra.get("steps", RECOMMEND_BASE["steps"]))
    stress_lr = max(cfg.lrs) if cfg.lrs else max(plan.LRS[2])
    seed0 = min(cfg.seeds) if cfg.seeds else 0
    if "stress" not in saved:
        calib_depth = min(user.config.n_layers, plan.MIN_DEPTH)
        log(f"  timing a training step of each candidate at {calib_depth} layers (the plan's costs)")
        step_s = {}
        for n in alive:
            step_s[n] = plan.time_train_step(n, proxy_shape(user.config, calib_depth))
        try:
            stress = plan.plan_stress(step_s, calib_depth, user.config.n_layers, steps, end - time.time(), workers,
                                      keep=current, depth=cfg.depth)
        except plan.BudgetTooSmall as err:
            need = time.time() - t0 + err.need_s + plan.REPORT_RESERVE_S
            raise ConfigError(f"{err}: give --budget {math.ceil(need / 60)} or more, fewer --candidates, or fewer "
                              "steps (--set steps=N); what is done so far is kept") from None
        saved["stress"] = {**stress.to_dict(), "calib_depth": calib_depth, "step_seconds": step_s, "lr": stress_lr,
                           "seed": seed0, "depth_fixed": cfg.depth is not None}
        atomic_write_json(folder.plan_file, saved)
    stress = saved["stress"]
    base = _base(user, stress["depth"], precision, extra)
    depth_note = ("your depth" if stress["depth"] == user.config.n_layers else "as given by --depth" if cfg.depth
                  else f"your {user.config.n_layers} cut to fit the budget")
    log(f"  {len(stress['candidates'])} runs at lr {stress_lr:g}, seed {seed0}, {stress['depth']} layers ({depth_note}), "
        f"{steps} steps, {precision} storage; about {stress['seconds'] / 60:.1f} min with the final round")
    for n, why in stress["dropped"].items():
        log(f"  not trained: {n}: {why}")
    fallback = {n: plan.run_seconds(s * stress["depth"] / stress["calib_depth"], steps)
                for n, s in stress["step_seconds"].items()}
    last_run = max((fallback[n] for n in stress["candidates"]), default=0.0)
    run_sweep(_sweep(base, stress["candidates"], [stress_lr], [seed0]), folder.grid.path, workers=workers, log=log,
              deadline=Deadline(start_by=end - last_run, stop_at=end))
    runs, _ = load_sweep(folder.grid.path)
    mark()

    # 3. the final round
    log(f"\n3/3 final round {_clock(t0, budget_s)}")
    order = _stress_order(runs, screen["results"], stress["candidates"], stress_lr, seed0)
    if "final" not in saved:
        run_s = _measured_run_seconds(runs, stress["candidates"], fallback)
        final = plan.plan_finals(order, run_s, end - time.time(), workers, stress_lr, seed0, keep=current,
                                 lrs=tuple(cfg.lrs), seeds=tuple(cfg.seeds))
        final = {**final.to_dict(), "run_seconds": run_s}
        if final["finalists"]:  # an empty plan is not kept: a resumed recommendation plans its final round anew
            saved["final"] = final
            atomic_write_json(folder.plan_file, saved)
    else:
        final = saved["final"]
    if final["finalists"]:
        log(f"  finalists {', '.join(final['finalists'])} x lr {', '.join(f'{x:g}' for x in final['lrs'])} x seeds "
            f"{', '.join(map(str, final['seeds']))}; about {final['seconds'] / 60:.1f} min")
        longest = max(final["run_seconds"][n] for n in final["finalists"])
        run_sweep(_sweep(base, final["finalists"], final["lrs"], final["seeds"]), folder.grid.path, workers=workers,
                  log=log, deadline=Deadline(start_by=end - longest, stop_at=end))
    else:
        log("  no time left for a final round: the ranking rests on the stress round")
    runs, _ = load_sweep(folder.grid.path)
    summarize(folder.grid.path)
    mark()

    # the ranking, the checks, the settings, the report
    result = _conclude(folder, user, precision, candidates, current, screen, out_by_screen, stress, final, order, runs,
                       extra, t0, budget_s, calls)
    mark()
    log("\n" + result["text"])
    log(f"done in {(time.time() - t0) / 60:.1f} min (budget {cfg.budget:g})\nrecommendation: {folder.markdown_file}\n"
        f"report: {folder.report_file}")
    return result


def _conclude(folder: RecommendDir, user: UserModel, precision: str, candidates: list[str], current: str | None,
              screen: dict[str, Any], out_by_screen: dict[str, str], stress: dict[str, Any], final: dict[str, Any],
              order: list[str], runs, extra: dict[str, Any], t0: float, budget_s: float,  # noqa: ANN001
              calls: list[float]) -> dict[str, Any]:
    finalists = final["finalists"] or order
    planned = {n: len(final["lrs"]) * len(final["seeds"]) if n in final["finalists"] else 1 for n in stress["candidates"]}
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: planned[n] for n in finalists})
    # the user's placement runs in the final round as the baseline even where the stress round did not put it
    # among the best; then it is ranked as those it displaced are, by its stress run, its final runs shown
    baseline = baseline_of(current, final["finalists"], order)
    rows = []
    for n in candidates:
        s = screen["results"][n]
        detail = f"{s['wellposedness']}; forward {s['forward']}; backward {s['backward']}"
        row = Evidence(layout=n, screen=s["verdict"], screen_detail=detail)
        if n in out_by_screen:
            row.status, row.why = "ruled out", f"by the screen: {out_by_screen[n]}"
        elif n in stress["dropped"]:
            row.status, row.why = "not trained", stress["dropped"][n]
        elif n not in finalists:
            one = evidence_from_grid(runs[runs.layout == n], {n: 1})[n]
            for k, v in one.items():
                setattr(row, k, v)
            row.status = "stress round only"
            status = runs[runs.layout == n].status
            row.why = f"{status.iloc[0] if len(status) else 'not run'} at lr {stress.get('lr', 0.1):g}"
        else:
            for k, v in grid[n].items():
                setattr(row, k, v)
            if n == baseline:
                row.status = "baseline"
                row.why = (f"ranked by its stress run, #{order.index(n) + 1} of {len(order)} there; in the final "
                           "round as your current placement")
        rows.append(row)
    ranked = rank(rows)
    # the candidates the final round did not take (and a baseline finalist) follow, in the stress round's order
    tail = sorted((r for r in ranked if r.status in ("stress round only", "baseline")),
                  key=lambda r: order.index(r.layout))
    head = [r for r in ranked if r.status == "ranked"]
    for i, r in enumerate(tail, len(head) + 1):
        r.rank = i
    ranked = head + tail + [r for r in ranked if r.status in ("ruled out", "not trained")]
    ranks = {r.layout: r.rank for r in ranked if r.rank is not None}
    checks = agreement.check(ranks, precision, agreement.cells(runs))
    winner = ranked[0] if ranked and ranked[0].rank is not None else None
    settings = settings_for(winner.layout, user.config) if winner else {}
    limits = report.limits(user, precision, stress, screen, extra)
    result = {"model": user.describe(), "notes": list(user.notes), "precision": precision, "current": current,
              "winner": winner.layout if winner else None, "ranking": [r.to_dict() for r in ranked],
              "recipe_checks": checks, "settings": settings, "limits": limits,
              "plan": {"screen_width": screen["width"], "depth": stress["depth"], "stress": stress, "final": final},
              "minutes": (time.time() - t0) / 60, "budget_minutes": budget_s / 60,
              "call_minutes": [*calls[:-1], (time.time() - t0) / 60],
              "files": {"grid": folder.grid_files(), "screen": folder.screen_file.name, "plan": folder.plan_file.name,
                        "json": folder.json_file.name}}
    text = report.markdown(result, ranked)
    result["text"] = text
    atomic_write_bytes(folder.markdown_file, text.encode())
    atomic_write_json(folder.json_file, {k: v for k, v in result.items() if k != "text"})
    report.write_page(folder, result, ranked)
    return result


__all__ = ["recommend"]
