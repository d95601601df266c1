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
    verify        (--verify) the ranking's best k trained again at a wider width, at the winner's best
                  learning rate, and ranked by the same rule (`normlab.experiments.transfer`): Kendall's tau
                  and top-1 agreement with the ranking, failures predicted vs seen; the recommendation is
                  written before it starts and again with its verdict

The proxies train with `--optimizer` (adamw, muon, sgd), as the user will; the plan counts Muon's
Newton-Schulz steps (`normlab.recommend.cost`).

The folder (`--out`) holds plan.json (the inputs and both rounds' plans: a resumed recommendation reuses
them), screen.json, grid/ (one sweep folder for both rounds: its summary.md and report.html), verify/
(the verify stage's sweep), and recommendation.md / recommendation.json / report.html. `--verify` on a
folder whose recommendation is done adds the verify stage alone, within this call's budget (refused with
the budget that would do where it does not fit). Run the same command again and only what is
missing runs (a changed input is refused: use a new --out).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normlab.config.commands import RECOMMEND_BASE, RecommendConfig, check_recommend_settings
from normlab.errors import ConfigError
from normlab.io import atomic_write_bytes, atomic_write_json, own_folder
from normlab.recommend import agreement, plan, report
from normlab.recommend.frameworks import settings_for
from normlab.recommend.rank import (
    Evidence,
    baseline_of,
    evidence_from_grid,
    rank,
    ruled_out,
    screen_reason,
    screen_summary,
)
from normlab.recommend.shape import PROXY_WIDTH, UserModel, proxy_shape, screen_shape
from normlab.runs.files import RecommendDir

if TYPE_CHECKING:
    import pandas as pd

    from normlab.experiments.runner import Deadline as DeadlineType
    from normlab.experiments.sweep import SweepConfig

SCREEN_STRESSES = (1.0, 8.0)  # the screen's verdicts compare the lowest and highest stress


def _clock(t0: float, budget_s: float) -> str:
    used = time.time() - t0
    return f"[{used / 60:.1f} of {budget_s / 60:g} min]"


def _m(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _has_streams(names: list[str]) -> bool:
    """Whether a layout of `names` has several residual streams (the plan then needs the stream rates)."""
    from normlab.layout import as_layout

    return any(as_layout(n).streams > 1 for n in names)


def _unbuildable(name: str, user: UserModel) -> str | None:
    """Why `name` cannot be built for the user's model (e.g. nGPT on grouped key/value heads), or None: what the
    model refuses (`ModelConfig.layout_problem`), at the proxies' shape and the user's depth (the screen's)."""
    from normlab.layout import as_layout
    from normlab.model.config import ModelConfig

    shape = ModelConfig(**proxy_shape(user.config, user.config.n_layers))
    return shape.layout_problem(as_layout(name).resolve(shape.n_layers))


def _candidates(cfg: RecommendConfig, user: UserModel) -> tuple[list[str], str | None, dict[str, str]]:
    """The candidates (the user's current placement first, under its own name), that placement's name, and
    the default candidates left out because the user's model cannot take them (name -> why); the same
    placement given twice (by two names, or one name twice), or one given that the model cannot take, is
    refused."""
    from normlab.config.commands import RECOMMEND_CANDIDATES
    from normlab.layout import as_layout

    seen: dict[str, str] = {}
    for name in cfg.candidates:
        form = as_layout(name).to_string()  # a typo fails here, with the valid names
        if form in seen:
            same = (
                f"{name!r} is given twice"
                if seen[form] == name
                else f"{seen[form]!r} and {name!r} are the same placement ({form})"
            )
            raise ConfigError(f"--candidates: {same}; give each placement once")
        seen[form] = name
    names = list(seen.values())
    current = None
    if user.layout is not None:
        want = as_layout(user.layout).to_string()
        current = seen.get(want, user.layout)
        names = [current] + [n for n in names if n != current]
    unfit = {n: why for n in names if (why := _unbuildable(n, user))}
    given = tuple(cfg.candidates) != RECOMMEND_CANDIDATES
    if unfit and (given or current in unfit):
        name, why = next((n, w) for n, w in unfit.items() if n == current or given)
        if name == current:
            raise ConfigError(f"your current placement {name} cannot be built at the proxies' shape ({why})")
        raise ConfigError(f"--candidates: {name} cannot be built for your model ({why}); leave it out")
    return [n for n in names if n not in unfit], current, unfit


def _inputs(
    user: UserModel, cfg: RecommendConfig, precision: str, base: dict[str, Any], candidates: list[str]
) -> dict[str, Any]:
    return {
        "model": user.config.to_dict(),
        "precision": precision,
        "candidates": candidates,
        "lrs": list(cfg.lrs),
        "seeds": list(cfg.seeds),
        "depth": cfg.depth,
        "optimizer": cfg.optimizer,
        "base": base,
        "proxy": RECOMMEND_BASE,
    }


def _check_run_settings(base: dict[str, Any], name: str, lr: float, seed: int, log: Callable) -> None:
    """Every proxy run's settings and data, checked before anything is screened: a bad --set value, a
    data path that does not exist, a tokenizer that cannot be read fail here, as one line."""
    from normlab.data import load_data

    spec = _sweep(base, [name], [lr], [seed]).expand()[0]
    cfg = spec.train_config("unused")
    if cfg.data.task != "lm":
        raise ConfigError(f"--set task={cfg.data.task}: the proxies train a language model on text (task lm)")
    data = load_data(
        cfg.data.data,
        cfg.data.tokenizer,
        cfg.data.val_fraction,
        cfg.data.text_field,
        cfg.data.token_dtype,
        cfg.data.vocab_size,
    )  # tokens cached: the runs read them from there
    need = cfg.data.seq_len + 1
    if len(data.train) < need * 2 or len(data.val) < need:
        raise ConfigError(
            f"data {cfg.data.data} holds {len(data.train) + len(data.val):,} tokens: too few for "
            f"sequences of {cfg.data.seq_len}; give more text or --set seq_len=N"
        )
    log(f"  proxy runs' settings and data checked ({cfg.data.data}: {len(data.train):,} training tokens)")


def _screen(
    folder: RecommendDir,
    user: UserModel,
    names: list[str],
    width: int,
    predicted_each: float,
    log: Callable,
    stop_by: float = math.inf,
) -> dict[str, Any]:
    """Screen `names` at the user's depth and `width`; resumable (each result kept as it exists). No
    screen starts after `stop_by` (time.time()): the screen keeps to its share of the budget."""
    from tqdm import tqdm

    from normlab.config.commands import ScreenConfig
    from normlab.screen.screen import screen_layout

    saved = folder.read(folder.screen_file) or {
        "width": width,
        "n_layers": user.config.n_layers,
        "results": {},
        "predicted_seconds_each": predicted_each,
    }
    cfg = ScreenConfig(size="nano", model=screen_shape(user.config, width, 64), stresses=SCREEN_STRESSES)
    todo = [c for c in names if c not in saved["results"]]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrated; more threads on small tensors only spin, worst on a loaded machine
    bar = tqdm(
        total=len(names), initial=len(names) - len(todo), desc="screen", unit="layout", dynamic_ncols=True, disable=None
    )
    started = time.perf_counter()
    try:
        for i, name in enumerate(todo, 1):
            if time.time() > stop_by:
                log(
                    f"  time budget: {len(todo) - i + 1} screen(s) not started ({', '.join(todo[i - 1 :])}); run the "
                    "same command again to screen them"
                )
                break
            bar.set_postfix_str(name)
            result = screen_summary(screen_layout(name, cfg))
            saved["results"][name] = result
            atomic_write_json(folder.screen_file, saved)  # each result kept the moment it exists
            bar.update(1)
            if bar.disable:  # a log, not a terminal: the bar's ETA as words
                left = len(todo) - i
                eta = f"; {left} left, ETA {left * (time.perf_counter() - started) / i / 60:.1f} min" if left else ""
                log(f"  screen {name}: {result['verdict']} ({result['seconds']:.1f} s{eta})")
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return saved


def _base(
    user: UserModel,
    depth: int,
    precision: str,
    extra: dict[str, Any],
    optimizer: str = "adamw",
    width: int = PROXY_WIDTH,
) -> dict[str, Any]:
    """The proxy runs' settings: the stress settings, the user's block at the proxy shape (`width`: the
    verify stage's), their precision stored (emulated on a CPU), their optimizer, and their own --set on top."""
    from normlab.model.config import SIZES

    ref = SIZES[RECOMMEND_BASE["size"]].to_dict()
    model = {f"model.{k}": v for k, v in proxy_shape(user.config, depth, width).items() if ref.get(k) != v}
    return {**RECOMMEND_BASE, **model, "activation_dtype": precision, "optimizer": optimizer, **extra}


def _sweep(
    base: dict[str, Any],
    layouts: list[str],
    lrs: list[float],
    seeds: list[int],
    name: str = "recommend",
) -> SweepConfig:
    from normlab.experiments.sweep import SweepConfig

    width = base.get("model.d_model", PROXY_WIDTH)
    return SweepConfig(
        name=name,
        base=base,
        grid={"layout": layouts, "lr": lrs, "seed": seeds},
        source="normlab recommend: the proxy grid" + (" (verify: wider)" if width != PROXY_WIDTH else ""),
        scale=f"proxy d {width}, {base.get('model.n_layers', 12)} layers, {base['steps']} steps, "
        f"{base['activation_dtype']} storage, {base.get('optimizer', 'adamw')}",
    )


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
        return (
            {"ok": 0, "stalled": 1, "diverged": 2}.get(status, 3),
            value,
            VERDICT_ORDER.get(screen[name]["verdict"], 3),
        )

    return sorted(candidates, key=key)


def _round(name: str, predicted: float, started: float, runs, layouts: list[str], planned: int) -> dict[str, Any]:  # noqa: ANN001
    """A stage's record: predicted and actual seconds, runs planned and finished."""
    mine = runs[runs.layout.isin(layouts)] if len(runs) else runs
    finished = int(mine.status.isin(("ok", "stalled", "diverged")).sum()) if len(mine) else 0
    return {
        "stage": name,
        "predicted_s": predicted,
        "actual_s": time.time() - started,
        "planned": planned,
        "finished": min(finished, planned),
    }


def _edges(runs, finalists: list[str], lrs: list[float]) -> dict[str, float]:  # noqa: ANN001
    """Finalists whose best learning rate is the lowest or highest tried -> the next one beyond it."""
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: 1 for n in finalists})
    out = {}
    for n in finalists:
        best = grid[n].get("best_lr")
        if best is None or len(lrs) < 2:
            continue
        if (
            best <= min(lrs) * (1 + 1e-9)
            and (beyond := plan.next_lr(min(lrs), up=False))
            or best >= max(lrs) * (1 - 1e-9)
            and (beyond := plan.next_lr(max(lrs), up=True))
        ):
            out[n] = beyond
    return out


def _verify_added(
    folder: RecommendDir,
    p: dict[str, Any],
    user: UserModel,
    cfg: RecommendConfig,
    budget_s: float,
    workers: int,
    log: Callable,
) -> dict[str, Any] | None:
    """--verify on a folder planned without it: the verify stage within this call's budget. Where the
    recommendation is done, verifying is all this call asks: refused (exit 2) if the budget cannot buy it;
    else (rounds still to run) said in one line and the recommendation goes on without it."""
    from normlab.recommend import cost

    names = p["screened"]
    cal, _ = cost.calibration(max(1, (os.cpu_count() or 1) // workers), log=log, streams=_has_streams(names))
    done = folder.json_file.is_file()
    reserve = (plan.STARTUP_RESERVE_S + plan.REPORT_RESERVE_S) * cal.speed
    room = (budget_s - reserve) * plan.FILL - (0.0 if done else p["predicted"]["total"])
    stage, why, need_s = plan.verify_plan(names, user.config, cal, room, workers, p["depth"], p["steps"], cfg.optimizer)
    if stage is None:
        if math.isfinite(need_s):
            rounds_s = 0.0 if done else p["predicted"]["total"]
            need = math.ceil((need_s / plan.FILL + reserve + rounds_s) / 60)
            why = (
                f"--verify: --budget {cfg.budget:g} min cannot buy the verify stage (2 runs at width "
                f"{plan.verify_widths(user.config)[0]}); give --budget {need} or more ({plan.calibration_used(cal)})"
            )
        if done:
            raise ConfigError(why)
        log(f"  {why}; recommending without it")
        return None
    log(f"  --verify added to this recommendation: the best {stage['k']} at width {stage['width']}")
    return {**stage, "seed": p["seed0"]}


def _verify(
    folder: RecommendDir,
    v: dict[str, Any],
    result: dict[str, Any],
    runs: pd.DataFrame,
    user: UserModel,
    precision: str,
    extra: dict[str, Any],
    optimizer: str,
    workers: int,
    t0: float,
    budget_s: float,
    stop_at: float,
    log: Callable,
    run_sweep: Callable[..., dict[str, int]],
    Deadline: type[DeadlineType],
    load_sweep: Callable[[str | Path], tuple[pd.DataFrame, list[str]]],
) -> dict[str, Any]:
    """The verify stage: the ranking's best k trained at `v["width"]` at the winner's best lr, ranked by
    the transfer study's rule, compared with the ranking (experiments.transfer)."""
    from normlab.experiments import transfer

    ranked = [r for r in result["ranking"] if r.get("rank") is not None]
    top = [r["layout"] for r in ranked[: v["k"]]]
    record: dict[str, Any] = {**v, "candidates": top}
    if len(top) < 2:
        return {**record, "status": "not run", "why": f"{len(top)} candidate(s) ranked: nothing to order"}
    lr = ranked[0].get("best_lr") or result["plan"]["stress"]["lr"]
    record["lr"] = lr
    log(
        f"\nverify {_clock(t0, budget_s)}: {', '.join(top)} at width {v['width']} ({v['width'] // PROXY_WIDTH}x the "
        f"proxy), {v['depth']} layers, {v['steps']} steps, lr {lr:g} (the winner's best), seed {v['seed']}; predicted "
        f"{_m(v['predicted_s'])}"
    )
    began = time.time()
    base = _base(user, v["depth"], precision, extra, optimizer, width=v["width"])
    run_sweep(
        _sweep(base, top, [lr], [v["seed"]], name="recommend-verify"),
        folder.verify.path,
        workers=workers,
        log=log,
        deadline=Deadline(start_by=stop_at - v["predicted_s"] / 2, stop_at=stop_at),
    )
    wide, _ = load_sweep(folder.verify.path)
    record["round"] = _round("verify", v["predicted_s"], began, wide, top, len(top))
    log(
        f"  verify done in {_m(time.time() - began)} (predicted {_m(v['predicted_s'])}); "
        f"{record['round']['finished']} of {len(top)} runs finished"
    )
    table = transfer.rank_sweep(wide)
    order = [x for x in table.layout if x in top]
    said = {
        r.layout: (f"{r.failed}/{r.finished} failed" if r.failed else f"loss {r.best_loss:.3f}")
        for r in table.itertuples(index=False)
    }
    if len(order) < 2:
        return {
            **record,
            "status": "unfinished",
            "why": f"{len(order)} of {len(top)} runs finished: nothing to order "
            "(run the same command again to finish them)",
        }
    agree = transfer.order_agreement([x for x in top if x in order], order)
    mine = runs[runs.layout.isin(top)] if len(runs) else runs
    tally, disagree = transfer.failure_tally(transfer.failure_cells(mine, [lr]), transfer.failure_cells(wide, [lr]))
    held = (
        "held"
        if agree.proxy_order == order
        else ("the winner held, the order below it changed" if agree.top1 else "did not hold: another placement won")
    )
    words = (
        f"At width {v['width']} ({v['width'] // PROXY_WIDTH}x the proxy) the order {held}: "
        f"{' > '.join(f'{x} ({said[x]})' for x in order)} against the ranking's {' > '.join(agree.proxy_order)} "
        f"(Kendall's tau "
        f"{agree.tau:+.2f} over {len(order)} placements, top-1 {'agrees' if agree.top1 else 'differs'}; "
        f"failures at lr {lr:g}: {tally['predicted_and_seen']} predicted and seen, {tally['predicted_only']} "
        f"predicted only, {tally['seen_only']} seen only, {tally['neither']} neither). One seed, "
        f"{v['steps']} steps: a check of the order, not of the loss gap at your width."
    )
    return {
        **record,
        "status": "done",
        "held": agree.proxy_order == order,
        "top1": agree.top1,
        "tau": agree.tau,
        "p_value": agree.p_value,
        "proxy_order": agree.proxy_order,
        "verify_order": order,
        "failures": tally,
        "failures_disagreeing": disagree,
        "words": words,
    }


def recommend(
    user: UserModel,
    cfg: RecommendConfig,
    extra: dict[str, Any] | None = None,
    log: Callable[[str], Any] = print,
    started: float | None = None,
) -> dict[str, Any]:
    """Run the stages within `cfg.budget` minutes from `started` (the command's start; default now);
    returns the recommendation (also written to the folder)."""
    from normlab.experiments.runner import Deadline, run_sweep
    from normlab.experiments.summary import load_sweep, summarize
    from normlab.recommend import cost
    from normlab.runs.start import FolderLock

    t0 = started or time.time()
    budget_s = cfg.budget * 60
    stop_at = t0 + budget_s - plan.REPORT_RESERVE_S
    workers = cfg.workers or os.cpu_count() or 1
    precision = cfg.precision or user.precision or "bf16"
    extra = dict(extra or {})
    check_recommend_settings(extra)
    candidates, current, unfit = _candidates(cfg, user)
    if unfit:  # default candidates this model cannot take: said wherever the notes are (output, recommendation)
        notes = [f"left out of the default candidates: {n} (your model cannot take it: {w})" for n, w in unfit.items()]
        user = replace(user, notes=(*user.notes, *notes))
    if cfg.depth is not None and cfg.depth > user.config.n_layers:
        raise ConfigError(
            f"--depth {cfg.depth} is deeper than your model ({user.config.n_layers} layers): the proxies "
            f"are at most your depth; give --depth {min(user.config.n_layers, plan.MIN_DEPTH)} ... "
            f"{user.config.n_layers}"
        )
    steps = int(extra.get("steps", RECOMMEND_BASE["steps"]))
    ns_steps = int(extra.get("muon_ns_steps", 5))
    stress_lr = max(cfg.lrs) if cfg.lrs else max(plan.LRS[2])
    seed0 = min(cfg.seeds) if cfg.seeds else 0
    log(f"recommend: {user.describe()}")
    for note in user.notes:
        log(f"  note: {note}")
    log(
        f"  precision {precision}; optimizer {cfg.optimizer}; {len(candidates)} candidates; "
        f"budget {cfg.budget:g} min on "
        f"{workers} worker(s) "
        f"-> {cfg.out}"
    )

    # 0. the plan: settings checked, costs counted, nothing screened or trained yet
    log(f"\n0/3 plan {_clock(t0, budget_s)}")
    folder = RecommendDir(Path(cfg.out))
    saved = folder.read(folder.plan_file) if folder.plan_file.is_file() else {}
    inputs = None
    threads = max(1, (os.cpu_count() or 1) // workers)
    if not saved.get("plan"):
        cal, cached = cost.calibration(threads, log=log, streams=_has_streams(candidates), remeasure=cfg.recalibrate)
        log(
            f"  this machine: {cal.speed:.2f}x the reference VM's step time "
            + ("(cached calibration)" if cached else f"(calibrated in {cal.seconds:.1f} s)")
        )
        try:
            the_plan = plan.make_plan(
                candidates,
                current,
                user.config,
                cal,
                budget_s,
                workers,
                steps,
                stress_lr,
                seed0,
                tuple(cfg.lrs),
                tuple(cfg.seeds),
                cfg.depth,
                steps_fixed="steps" in extra,
                optimizer=cfg.optimizer,
                ns_steps=ns_steps,
                verify=cfg.verify,
            )
        except plan.BudgetTooSmall as err:
            raise ConfigError(str(err)) from None
        depth = the_plan.depth
    else:
        depth = saved["plan"]["depth"]
        if cfg.recalibrate:  # measured as asked; the plan this folder holds stays (the same command resumes it)
            cal, _ = cost.calibration(threads, log=log, streams=False, remeasure=True)
            log(f"  this machine: {cal.describe()}; {folder.plan_file.name}'s plan is kept, the next plans use it")
    base = _base(user, depth, precision, extra, cfg.optimizer)
    inputs = _inputs(user, cfg, precision, extra, candidates)
    if saved and json.loads(json.dumps(saved.get("inputs"))) != json.loads(json.dumps(inputs)):
        changed = sorted(k for k in inputs if saved["inputs"].get(k) != json.loads(json.dumps(inputs[k])))
        raise ConfigError(
            f"{folder.path} holds a recommendation for other inputs (changed: {', '.join(changed)}); give a new --out"
        )
    if not saved.get("plan"):
        _check_run_settings(base, candidates[0], stress_lr, seed0, log)
    added = None
    if (
        cfg.verify
        and saved.get("plan")
        and not saved["plan"].get("verify")
        and (not saved["plan"].get("verify_note") or saved["plan"]["budget_s"] != budget_s)
    ):  # the same call: as before
        added = _verify_added(folder, saved["plan"], user, cfg, budget_s, workers, log)
    root = own_folder(cfg.out, "recommend")  # nothing written before this line: a refusal leaves no trace
    lock = FolderLock(
        folder.lock_file,
        wait=0,
        busy=lambda holder: (
            f"another normlab recommend is running in {root} ({holder}); wait for it, or give another --out"
        ),
    )
    try:
        saved = folder.read(folder.plan_file) or {"inputs": inputs}  # read again under the lock
        if not saved.get("plan"):
            saved["plan"] = the_plan.to_dict()
        if added and not saved["plan"].get("verify"):
            saved["plan"]["verify"], saved["plan"]["verify_note"] = added, ""
            predicted = saved["plan"]["predicted"]
            predicted["total"] += added["predicted_s"] - predicted.get("verify", 0.0)
            predicted["verify"] = added["predicted_s"]
        return _stages(
            folder,
            saved,
            user,
            cfg,
            precision,
            extra,
            candidates,
            current,
            base,
            t0,
            budget_s,
            stop_at,
            workers,
            log,
            run_sweep,
            Deadline,
            load_sweep,
            summarize,
        )
    finally:
        lock.release()


def _stages(
    folder: RecommendDir,
    saved: dict[str, Any],
    user: UserModel,
    cfg: RecommendConfig,
    precision: str,
    extra: dict[str, Any],
    candidates: list[str],
    current: str | None,
    base: dict[str, Any],
    t0: float,
    budget_s: float,
    stop_at: float,
    workers: int,
    log: Callable,
    run_sweep: Callable[..., dict[str, int]],
    Deadline: type[DeadlineType],
    load_sweep: Callable[[str | Path], tuple[pd.DataFrame, list[str]]],
    summarize: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    p = saved["plan"]
    calls = saved.setdefault("call_minutes", [])  # each call's time, kept at every stage: a resumed one adds to it
    calls.append(0.0)
    rounds: list[dict[str, Any]] = []
    saved["rounds"] = rounds  # this call's stages (a resumed call counts only what it ran)

    def mark() -> None:
        calls[-1] = (time.time() - t0) / 60
        atomic_write_json(folder.plan_file, saved)

    mark()
    pred = p["predicted"]
    final_lrs = ", ".join(f"{x:g}" for x in p["lrs"])
    log(
        f"  plan (kept in {folder.plan_file.name}; the same command resumes it): screen {len(p['screened'])} of "
        f"{len(p['order'])} candidates at width {p['screen_width']}; stress round at {p['depth']} layers, {p['steps']} "
        f"steps, lr {p['stress_lr']:g}; "
        + (
            f"final round {p['finalists']} finalists x lr {final_lrs} x {len(p['seeds'])} seed(s)"
            if p["finalists"]
            else "no final round"
        )
        + ("; an edge learning rate extended where needed" if p["extend"] else "")
        + f"; predicted {_m(pred['total'])} of {budget_s / 60:g}"
    )
    for cut in p["cut"]:
        log(f"  the budget buys: {cut}")
    if p.get("verify_note"):
        log(f"  {p['verify_note']}")

    # 1. the screen
    log(
        f"\n1/3 screen {_clock(t0, budget_s)}: {len(p['screened'])} candidates at your depth {user.config.n_layers}, "
        f"width {p['screen_width']}; predicted {_m(pred['screen'])}"
    )
    began = time.time()
    screen = _screen(
        folder,
        user,
        p["screened"],
        p["screen_width"],
        pred["screen"] / max(1, len(p["screened"])),
        log,
        stop_by=stop_at - pred["stress"],
    )
    done = [n for n in p["screened"] if n in screen["results"]]
    rounds.append(
        {
            "stage": "screen",
            "predicted_s": pred["screen"],
            "actual_s": time.time() - began,
            "planned": len(p["screened"]),
            "finished": len(done),
        }
    )
    log(f"  screen done in {_m(time.time() - began)} (predicted {_m(pred['screen'])})")
    mark()
    slow = (time.time() - began) / pred["screen"] if pred["screen"] > 0 else 1.0
    if not done:
        raise ConfigError(
            f"the budget ran out before the screen finished one candidate (this machine ran {slow:.0f}x "
            "slower than its calibration: loaded?); nothing recommended; run the same command again to "
            "continue, or give a larger --budget"
        )
    out_by_screen = {n: why for n in done if (why := ruled_out(screen["results"][n], precision))}
    for n, why in out_by_screen.items():
        log(f"  ruled out: {n}: {why}")
    from normlab.recommend.rank import VERDICT_ORDER

    alive = sorted(
        (n for n in done if n not in out_by_screen),
        key=lambda n: (n != current, VERDICT_ORDER.get(screen["results"][n]["verdict"], 3)),
    )
    if not alive:
        raise ConfigError("the screen rules out every candidate screened (see screen.json); give other --candidates")

    # 2. the stress round
    lr, seed0 = p["stress_lr"], p["seed0"]
    log(
        f"\n2/3 stress round {_clock(t0, budget_s)}: {len(alive)} runs at lr {lr:g}, seed {seed0}, {p['depth']} layers"
        f" ({'your depth' if p['depth'] == user.config.n_layers else f'yours: {user.config.n_layers}'}), {p['steps']} "
        f"steps, {precision} storage; predicted {_m(pred['stress'])}"
    )
    began = time.time()
    longest = pred["stress"] / max(1, math.ceil(len(alive) / workers))  # about one run
    run_sweep(
        _sweep(base, alive, [lr], [seed0]),
        folder.grid.path,
        workers=workers,
        log=log,
        deadline=Deadline(start_by=stop_at - longest, stop_at=stop_at),
    )
    runs, _ = load_sweep(folder.grid.path)
    rounds.append(_round("stress", pred["stress"], began, runs[(runs.lr - lr).abs() <= 1e-9 * lr], alive, len(alive)))
    log(
        f"  stress round done in {_m(time.time() - began)} (predicted {_m(pred['stress'])}); "
        f"{rounds[-1]['finished']} of {len(alive)} runs finished"
    )
    mark()
    if not rounds[-1]["finished"]:
        stress_runs = runs[runs.layout.isin(alive)]
        failed = stress_runs[stress_runs.status == "failed"]
        if len(failed) and failed.reason.iloc[0] and "time budget" not in str(failed.reason.iloc[0]):
            why = f"every run failed; the first: {failed.reason.iloc[0]}"
        else:
            why = (
                f"the budget ran out before any run finished; the screen took {_m(rounds[0]['actual_s'])}, predicted "
                f"{_m(rounds[0]['predicted_s'])}: this machine ran slower than its calibration (loaded?)"
            )
        raise ConfigError(
            f"no candidate finished a run, so there is nothing to recommend ({why}); no recommendation "
            "written: run the same command again to continue (the plan and what finished are kept), or "
            "give a larger --budget"
        )

    # 3. the final round (and one learning rate beyond an edge)
    order = _stress_order(runs, screen["results"], alive, lr, seed0)
    finalists = plan.finalists_from(order, p["finalists"], current) if p["finalists"] else []
    final = {"finalists": finalists, "lrs": p["lrs"], "seeds": p["seeds"], "extended": {}}
    if finalists:
        log(
            f"\n3/3 final round {_clock(t0, budget_s)}: {', '.join(finalists)} x lr "
            f"{', '.join(f'{x:g}' for x in p['lrs'])} x seed(s) {', '.join(map(str, p['seeds']))}; predicted "
            f"{_m(pred['final'])}"
        )
        began = time.time()
        run_sweep(
            _sweep(base, finalists, p["lrs"], p["seeds"]),
            folder.grid.path,
            workers=workers,
            log=log,
            deadline=Deadline(start_by=stop_at - longest, stop_at=stop_at),
        )
        runs, _ = load_sweep(folder.grid.path)
        in_grid = runs[runs.lr.isin(p["lrs"]) & runs.seed.isin(p["seeds"])]
        rounds.append(
            _round("final", pred["final"], began, in_grid, finalists, len(finalists) * len(p["lrs"]) * len(p["seeds"]))
        )
        log(
            f"  final round done in {_m(time.time() - began)} (predicted {_m(pred['final'])}); "
            f"{rounds[-1]['finished']} of {rounds[-1]['planned']} runs finished"
        )
        edges = _edges(in_grid, finalists, p["lrs"])
        final["edges"] = {n: lr_ for n, lr_ in edges.items()}
        if edges and p["extend"]:
            began = time.time()
            log(
                "  best learning rate at an edge of those tried: "
                + "; ".join(f"{n} -> also {x:g}" for n, x in edges.items())
                + f"; predicted {_m(pred['extend'])}"
            )
            for x in sorted(set(edges.values())):
                run_sweep(
                    _sweep(base, [n for n, v in edges.items() if v == x], [x], p["seeds"]),
                    folder.grid.path,
                    workers=workers,
                    log=log,
                    deadline=Deadline(start_by=stop_at - longest, stop_at=stop_at),
                )
            runs, _ = load_sweep(folder.grid.path)
            final["extended"] = edges
            rounds.append(
                _round(
                    "extend",
                    pred["extend"],
                    began,
                    runs[runs.lr.isin(sorted(set(edges.values())))],
                    list(edges),
                    len(edges) * len(p["seeds"]),
                )
            )
        elif edges:
            log(
                "  best learning rate at an edge of those tried: "
                + ", ".join(f"{n} (next: {x:g})" for n, x in edges.items())
                + "; the budget has no room to extend the range"
            )
        mark()
    else:
        log(f"\n3/3 final round {_clock(t0, budget_s)}: none in this budget; the ranking rests on the stress round")
    summarize(folder.grid.path)
    mark()
    _refresh_calibration(folder, user, screen, workers, log)

    # the ranking, the checks, the settings, the report (written now: the verify stage adds to it)
    args = (
        folder,
        user,
        precision,
        candidates,
        current,
        screen,
        out_by_screen,
        p,
        final,
        order,
        runs,
        extra,
        t0,
        budget_s,
        calls,
        rounds,
        cfg.depth is not None,
    )
    verified = (
        {"status": "not asked"}
        if not p.get("verify") and not p.get("verify_note")
        else {"status": "not bought", "why": p.get("verify_note")}
        if not p.get("verify")
        else None
    )
    result = _conclude(*args, verify=verified or {"status": "pending"})
    mark()
    if p.get("verify"):
        verified = _verify(
            folder,
            p["verify"],
            result,
            runs,
            user,
            precision,
            extra,
            p.get("optimizer", "adamw"),
            workers,
            t0,
            budget_s,
            stop_at,
            log,
            run_sweep,
            Deadline,
            load_sweep,
        )
        if "round" in verified:
            rounds.append(verified["round"])
        result = _conclude(*args, verify=verified)
        mark()
        log(f"  {verified.get('words') or verified['why']}")
    log("\n" + result["text"])
    log(
        f"done in {(time.time() - t0) / 60:.1f} min (budget {cfg.budget:g}; predicted {_m(pred['total'])})\n"
        f"recommendation: {folder.markdown_file}\nreport: {folder.report_file}"
    )
    return result


def _refresh_calibration(
    folder: RecommendDir, user: UserModel, screen: dict[str, Any], workers: int, log: Callable
) -> None:
    """The finished proxy runs' steps and the screens against this machine's cached calibration: lowered where
    they ran faster than it predicts (measured under a load), never raised (`cost.refresh_from_runs`)."""
    from normlab.model.config import ModelConfig
    from normlab.recommend import cost
    from normlab.runs.store import open_store

    if not folder.grid.store_file.is_file():
        return
    try:  # a record that cannot be read only leaves the calibration as it is
        steps = [
            step
            for row in open_store(folder.grid, readonly=True).rows()
            if (step := cost.run_step(row["config"], folder.grid.run(row["run_id"]).summary())) is not None
        ]
    except (ConfigError, OSError, ValueError):
        steps = []
    shape = ModelConfig(**screen_shape(user.config, screen["width"], 64))
    seconds = [r.get("seconds") for r in screen["results"].values() if isinstance(r, dict)]
    screens = [(shape, float(t)) for t in seconds if isinstance(t, (int, float)) and t > 0]
    cost.refresh_from_runs(max(1, (os.cpu_count() or 1) // workers), steps, screens, log=log)


def _conclude(
    folder: RecommendDir,
    user: UserModel,
    precision: str,
    candidates: list[str],
    current: str | None,
    screen: dict[str, Any],
    out_by_screen: dict[str, str],
    p: dict[str, Any],
    final: dict[str, Any],
    order: list[str],
    runs: pd.DataFrame,
    extra: dict[str, Any],
    t0: float,
    budget_s: float,
    calls: list[float],
    rounds: list[dict[str, Any]],
    depth_fixed: bool,
    verify: dict[str, Any] | None = None,
) -> dict[str, Any]:
    finalists = final["finalists"] or order
    per_final = len(final["lrs"]) * len(final["seeds"])
    extended = final.get("extended") or {}
    planned = {
        n: (per_final + (len(final["seeds"]) if n in extended else 0)) if n in final["finalists"] else 1 for n in order
    }
    grid = evidence_from_grid(runs[runs.layout.isin(finalists)], {n: planned[n] for n in finalists})
    # the user's placement runs in the final round as the baseline even where the stress round did not put it
    # among the best; then it is ranked as those it displaced are, by its stress run, its final runs shown
    baseline = baseline_of(current, final["finalists"], order)
    rows = []
    for n in candidates:
        if n not in screen["results"]:
            rows.append(
                Evidence(
                    layout=n,
                    screen="not screened",
                    screen_detail="",
                    status="not trained",
                    why=f"not tried in this budget (the cheap screen put it after the {len(p['screened'])} chosen)",
                )
            )
            continue
        s = screen["results"][n]
        detail = f"{s['wellposedness']}; forward {s['forward']}; backward {s['backward']}"
        row = Evidence(layout=n, screen=s["verdict"], screen_detail=detail, screen_why=screen_reason(s))
        if n in out_by_screen:
            row.status, row.why = "ruled out", f"by the screen: {out_by_screen[n]}"
        elif n not in finalists:
            one = evidence_from_grid(runs[runs.layout == n], {n: 1})[n]
            for k, v in one.items():
                setattr(row, k, v)
            row.status = "stress round only"
            status = runs[runs.layout == n].status
            row.why = f"{status.iloc[0] if len(status) else 'not run'} at lr {p['stress_lr']:g}"
        else:
            for k, v in grid[n].items():
                setattr(row, k, v)
            if n == baseline:
                row.status = "baseline"
                row.why = (
                    f"ranked by its stress run, #{order.index(n) + 1} of {len(order)} there; in the final "
                    "round as your current placement"
                )
        rows.append(row)
    ranked = rank(rows)
    # the candidates the final round did not take (and a baseline finalist) follow, in the stress round's order
    tail = sorted(
        (r for r in ranked if r.status in ("stress round only", "baseline")), key=lambda r: order.index(r.layout)
    )
    head = [r for r in ranked if r.status == "ranked"]
    for i, r in enumerate(tail, len(head) + 1):
        r.rank = i
    ranked = head + tail + [r for r in ranked if r.status in ("ruled out", "not trained")]
    ranks = {r.layout: r.rank for r in ranked if r.rank is not None}
    checks = agreement.check(ranks, precision, agreement.cells(runs))
    winner = ranked[0] if ranked and ranked[0].rank is not None else None
    settings = settings_for(winner.layout, user.config) if winner else {}
    stress = {"depth": p["depth"], "depth_fixed": depth_fixed, "candidates": order, "lr": p["stress_lr"]}
    limits = report.limits(user, precision, stress, screen, extra, ranked)
    result = {
        "model": user.describe(),
        "notes": list(user.notes),
        "precision": precision,
        "current": current,
        "winner": winner.layout if winner else None,
        "ranking": [r.to_dict() for r in ranked],
        "recipe_checks": checks,
        "settings": settings,
        "limits": limits,
        "optimizer": p.get("optimizer", "adamw"),
        "verify": verify or {"status": "not asked"},
        "transfer_record": report.transfer_record(),
        "plan": {
            "screen_width": screen["width"],
            "depth": p["depth"],
            "stress": stress,
            "final": final,
            "cut": p["cut"],
            "predicted": p["predicted"],
            "screened": p["screened"],
            "order": p["order"],
        },
        "rounds": rounds,
        "movement": report.movement(ranked, p, final, rounds),
        "minutes": (time.time() - t0) / 60,
        "budget_minutes": budget_s / 60,
        "call_minutes": [*calls[:-1], (time.time() - t0) / 60],
        "files": {
            "grid": folder.grid_files(),
            "screen": folder.screen_file.name,
            "plan": folder.plan_file.name,
            "json": folder.json_file.name,
        },
    }
    text = report.markdown(result, ranked)
    result["text"] = text
    atomic_write_bytes(folder.markdown_file, text.encode())
    atomic_write_json(folder.json_file, {k: v for k, v in result.items() if k != "text"})
    report.write_page(folder, result, ranked)
    return result


__all__ = ["recommend"]
