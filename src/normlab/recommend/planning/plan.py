"""How `normlab recommend` spends its budget: the whole plan, made once before anything is screened or
trained, from counted work and this machine's cached calibration (`normlab.recommend.planning.cost`), kept in
the output folder and reused on a resume. The same inputs on the same machine give the same plan:
nothing in it reads the clock.

A small budget buys a smaller answer, never a refusal while the smallest one fits:

    smallest    MIN_CANDIDATES candidates (your current placement and the cheap screen's first picks),
                each screened at your depth and trained once at the stress learning rate (one seed), at
                min(your depth, MIN_DEPTH) layers; with --quick (no screen), each candidate given trained
                with two seeds at the stress learning rate, at the deepest proxy where that fits
    then, each step taken while the whole plan still fits FILL of the time left after the reserves:
      1. a final round: the best of the stress round and your current placement at a second learning rate
      2. a second seed (the effect and the effective speedup against your placement have no interval without
         seed noise): both before the proxies grow to the standard depth and steps
      3. more candidates, up to FEW_CANDIDATES
      4. a third finalist
      5. one more learning rate beyond the edge, for the finalists whose best is the lowest or highest tried
      6. every candidate
      7. the final round for more finalists, up to all
      8. deeper proxies, up to your depth (`DEPTHS`)
      9. three, then four learning rates (`LRS`), a third seed
     10. a wider screen, up to your width, within SCREEN_SHARE of the budget
Where candidates are fewer than given, a cheap screen chose them: Kan et al.'s step 1 (well-posedness,
from the layout data alone: bounded, tangential, unbounded), one family in turn, in the order given.
`--lrs`, `--seeds` and `--depth` fix their dimension. Where not even the smallest answer fits, the
refusal (`BudgetTooSmall`) names the least budget that would do, the calibration the plan was priced with
(how fast, when measured, its cache file) and how to measure it again (`calibration_used`).

With `--verify`, the plan first sets aside a verify stage (`verify_plan`): the k best of the ranking
(k >= 2) trained once more at the widest width (128, 256, ... up to yours) where the 2 dearest candidates'
runs fit VERIFY_SHARE of the time left after the smallest answer, then k grown (up to VERIFY_MAX_K) while it
fits there; the proxy's rounds then grow in what remains. Where not even 2 runs at width 128 fit, the plan
holds no verify stage and says why in one line (`Plan.verify_note`), with the budget that would buy it.

The budget is the command's, counted from its start: what the call used before the plan (imports, reading
the model, measuring this machine where its calibration is not cached) is `PlanRequest.used_s`, counted in the
plan (`predicted["used"]`) in place of the startup's reserve, so the plan's total and the clock agree.

Round times are counted, not measured: each run's predicted seconds dealt to the workers longest first
(`cost.makespan`); the finalists' runs are priced at the dearest candidates (who they are is known only
after the stress round).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from normlab.errors import ConfigError
from normlab.layout import as_layout
from normlab.model.config import ModelConfig
from normlab.model.params import analytic_params
from normlab.recommend.evidence import ladder
from normlab.recommend.planning.cost import Calibration, makespan
from normlab.recommend.planning.plan_record import LadderPlan, Plan, VerifyStagePlan
from normlab.recommend.planning.shape import PROXY_WIDTH, proxy_shape, screen_shape
from normlab.screen.wellposed import wellposedness

# log-spaced, up to the stress lr (1: the stress lr alone, --quick's smallest answer)
LRS = {1: (1e-1,), 2: (1e-2, 1e-1), 3: (1e-2, 3e-2, 1e-1), 4: (3e-3, 1e-2, 3e-2, 1e-1)}
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # where an edge learning rate extends to
DEPTHS = (64, 48, 32, 24, 16, 12)
MIN_DEPTH = 12  # the standard proxy's depth (the stress recipes': Pre-LN's fp16 overflow shows by step 20)
SHALLOW_DEPTHS = (8, 6)  # a budget too small for MIN_DEPTH buys shallower proxies (then 2/3 of the steps)
MIN_CANDIDATES = 3
FEW_CANDIDATES = 6
SCREEN_SHARE = 0.2  # the screen may widen up to this share of the budget
FILL = 0.85  # the plan fills this share of the time left: room for a machine slower than calibrated
# a training round's own cost beyond its runs (x the machine's speed): the sweep's start, its worker processes'
# imports, its summary and the report's figures after it. Measured 2026-11-25 on the 2-core VM: the Llama 3.2
# 1B-shaped --budget 6 final round of 2 runs took 78-90 s against 60 s of runs
ROUND_OVERHEAD_S = 20.0
STARTUP_RESERVE_S = 10.0  # imports and reading the model, before the plan (x the machine's speed)
REPORT_RESERVE_S = 20.0  # the summaries, the figures and the report (x the machine's speed)

VERIFY_SHARE = 1 / 3  # the verify stage may take up to this share of the time left after the smallest answer
VERIFY_MAX_K = 4
SCREEN_MEMORY = 4 * 2**30  # the screen's float64 model at most this large
WELLPOSED_ORDER = ("bounded", "tangential", "unbounded")


class BudgetTooSmall(ValueError):
    """Not even the smallest answer fits; `minutes`: the least budget that would do."""

    def __init__(self, message: str, minutes: float) -> None:
        super().__init__(message)
        self.minutes = minutes


def calibration_used(cal: Calibration) -> str:
    """The words a budget refusal ends with: which calibration priced the plan and how to measure again."""
    return f"priced with this machine's calibration: {cal.describe()}; {cal.remeasure_hint()}"


def depths_for(user_depth: int) -> list[int]:
    """The proxy depths, shallowest first: min(user, MIN_DEPTH), the deeper of `DEPTHS`, the user's."""
    floor = min(user_depth, MIN_DEPTH)
    return sorted({floor, user_depth, *(d for d in DEPTHS if floor < d < user_depth)})


def cheap_order(
    candidates: list[str], current: str | None, first: tuple[str, ...] = (), last: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """The candidates in the cheap screen's order (the current placement first, then `first`: the changes
    that add to it, then one family of Kan's step 1 in turn: bounded, tangential, unbounded, each in the
    order given, then `last`: the changes that take something away from it) and each one's family."""
    family = {n: wellposedness(as_layout(n).resolve(2))["worst"] for n in candidates}
    head = [current] if current in candidates else []
    head += [n for n in first if n in candidates and n not in head]
    tail = [n for n in last if n in candidates and n not in head]
    queues = {f: [n for n in candidates if family[n] == f and n not in head + tail] for f in WELLPOSED_ORDER}
    order = head
    while any(queues.values()):
        for f in WELLPOSED_ORDER:
            if queues[f]:
                order.append(queues[f].pop(0))
    return order + tail, family


def next_lr(lr: float, up: bool) -> float | None:
    """The next learning rate of `LADDER` above or below `lr` (None past its end)."""
    ladder = [x for x in LADDER if (x > lr * (1 + 1e-9) if up else x < lr * (1 - 1e-9))]
    return (min(ladder) if up else max(ladder)) if ladder else None


@dataclass
class _State:
    n: int
    depth: int
    steps: int
    finalists: int
    n_lrs: int
    n_seeds: int
    extend: bool
    width: int
    ladder: int = 0  # 0: one rung; k: ladder.LADDERS[k - 1]


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is made for: the candidates (the current placement among them) on `user`'s shape, this
    machine's calibration, the budget and workers, the proxies' steps and what the user fixed (`lrs`,
    `seeds`, `depth`, `steps_fixed`), the optimizer the proxies train with, and whether to verify."""

    candidates: list[str]
    current: str | None
    user: ModelConfig
    cal: Calibration
    budget_s: float
    workers: int
    steps: int
    stress_lr: float = 0.1
    seed0: int = 0
    lrs: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()
    depth: int | None = None
    steps_fixed: bool = False
    optimizer: str = "adamw"
    ns_steps: int = 5
    verify: bool = False
    first: tuple[str, ...] = ()  # the changes that add to the user's placement: tried right after it
    last: tuple[str, ...] = ()  # the changes that take away from it: tried last
    screen: bool = True  # False: the quick question (no screen; `stage_screen`)
    ladders: tuple[int, ...] = (1, 2)  # the ladders the plan may buy (ladder.LADDERS, 1-based), widest first
    # seconds of the budget the call used before the plan (its imports, reading the model, measuring this
    # machine): counted in the plan in place of STARTUP_RESERVE_S, so the plan and the budget's clock agree
    used_s: float = 0.0


@dataclass(frozen=True)
class VerifyPricing:
    """The verify stage's price list: the dearest of `names` trained `steps` at `depth` with `optimizer`
    (Muon's `ns_steps` counted), on `user`'s ratios, dealt to `workers`."""

    names: list[str]
    user: ModelConfig
    cal: Calibration
    workers: int
    depth: int
    steps: int
    optimizer: str = "adamw"
    ns_steps: int = 5

    def seconds(self, k: int, width: int) -> float:
        """The round of the `k` dearest at `width`, dealt to the workers, and its overhead."""
        shape = ModelConfig(**proxy_shape(self.user, self.depth, width))
        runs = sorted(self.cal.run_seconds(shape, n, self.steps, self.optimizer, self.ns_steps) for n in self.names)
        return makespan(runs[-k:], self.workers) + ROUND_OVERHEAD_S * self.cal.speed


def verify_widths(user: ModelConfig) -> list[int]:
    """The verify stage's widths, narrowest first: 2x, 4x, ... the proxy's, up to the user's."""
    return [PROXY_WIDTH * 2**i for i in range(1, 12) if PROXY_WIDTH * 2**i <= user.d_model]


def verify_seconds(
    names: list[str], user: ModelConfig, cal: Calibration, workers: int, depth: int, steps: int, k: int, width: int
) -> float:
    """The verify stage's round with AdamW: the `k` dearest of `names` at `width`, dealt to the workers, and
    its overhead (`VerifyPricing` prices another optimizer)."""
    return VerifyPricing(names, user, cal, workers, depth, steps).seconds(k, width)


def verify_plan(pricing: VerifyPricing, room_s: float, seed: int = 0) -> tuple[VerifyStagePlan | None, str, float]:
    """The verify stage within `room_s` seconds, for the best of `pricing.names` (priced at the dearest of
    them), trained with `seed`: the widest width where 2 runs fit, then k grown while it fits there. (stage, "",
    its seconds), or (None, why not, the seconds 2 runs at the first width would need: inf where none can be
    bought)."""
    names, user, cost = pricing.names, pricing.user, pricing.seconds
    widths = verify_widths(user)
    if len(names) < 2:
        return None, f"--verify needs 2 candidates trained; this recommendation has {len(names)}", math.inf
    if not widths:
        return (
            None,
            (
                f"--verify: your model (d {user.d_model}) is no wider than the proxies; there is no wider width "
                "to verify at"
            ),
            math.inf,
        )
    fitting = [w for w in widths if cost(2, w) <= room_s]
    if not fitting:
        return None, f"2 runs at width {widths[0]} do not fit", cost(2, widths[0])
    w = fitting[-1]
    k = 2
    while k < min(VERIFY_MAX_K, len(names)) and cost(k + 1, w) <= room_s:
        k += 1
    return VerifyStagePlan(k, w, pricing.depth, pricing.steps, seed, cost(k, w)), "", cost(k, w)


def make_plan(
    candidates: list[str],
    current: str | None,
    user: ModelConfig,
    cal: Calibration,
    budget_s: float,
    workers: int,
    steps: int,
    **options: Any,
) -> Plan:
    """The plan (module doc) for `candidates` (the current placement among them) on `user`'s shape;
    `options`: the rest of `PlanRequest` (its proxies' optimizer, with Muon's Newton-Schulz steps counted,
    what the user fixed, and a verify stage if asked)."""
    return plan_for(PlanRequest(candidates, current, user, cal, budget_s, workers, steps, **options))


def plan_for(request: PlanRequest) -> Plan:
    """The plan (module doc) for `request`: the smallest answer that fits, grown step by step while it fits."""
    planner = _Planner(request)
    state = planner.smallest()
    note = planner.set_aside_verify(state)
    return planner.plan(planner.grow(state), note)


class _Planner:
    """Prices states of the plan (`_State`: how many candidates, how deep, how many finalists, ...) and
    grows the smallest one that fits in the module doc's order."""

    def __init__(self, request: PlanRequest) -> None:
        self.req = r = request
        user = r.user
        self.order, _ = cheap_order(r.candidates, r.current, r.first, r.last)
        # what the call used before the plan where it says (`PlanRequest.used_s`), else the startup's reserve
        self.used = r.used_s if r.used_s > 0 else 0.0
        self.reserve = (REPORT_RESERVE_S + (0.0 if self.used else STARTUP_RESERVE_S)) * r.cal.speed + self.used
        self.usable = (r.budget_s - self.reserve) * FILL
        self.vstage: tuple[int, int] | None = None  # the verify stage's k and width, once chosen
        self.standard = r.depth or min(user.n_layers, MIN_DEPTH)
        shallow = (d for d in SHALLOW_DEPTHS if d < self.standard)
        self.depths = [r.depth] if r.depth else sorted({*shallow, *depths_for(user.n_layers)})
        widths = [w for w in [*(2**k for k in range(6, 17)), user.d_model] if w <= user.d_model] or [user.d_model]
        self.widths = _fitting_widths(user, sorted(set(widths)))
        _check_proxy_memory(user, self.depths[0], r.workers)
        self._runs: dict[tuple[str, int, int, int], float] = {}

    def run_s(self, name: str, d: int, n_steps: int, width: int = PROXY_WIDTH) -> float:
        r = self.req
        if (name, d, n_steps, width) not in self._runs:
            self._runs[name, d, n_steps, width] = r.cal.run_seconds(
                ModelConfig(**proxy_shape(r.user, d, width)), name, n_steps, r.optimizer, r.ns_steps
            )
        return self._runs[name, d, n_steps, width]

    def ladder_s(self, s: _State) -> float:
        """The ladder's rungs beside the proxy: the two dearest candidates (who the user's placement's rival is
        is known only after the final round), each its seeds in a sweep of its own at each rung."""
        total = 0.0
        for w in ladder.off_proxy(ladder.LADDERS[s.ladder - 1]):
            st = ladder.rung_steps(w, s.steps)
            dear = sorted(self.run_s(n, s.depth, st, w) for n in self.order[: s.n])[-2:]
            total += sum(self.round_s([t] * self.n_seeds(s)) for t in dear)
        return total

    def screen_s(self, w: int) -> float:
        return self.req.cal.screen_seconds(ModelConfig(**screen_shape(self.req.user, w, 64)))

    def n_lrs(self, s: _State) -> int:
        return len(self.req.lrs) if self.req.lrs else s.n_lrs

    def n_seeds(self, s: _State) -> int:
        return len(self.req.seeds) if self.req.seeds else s.n_seeds

    def round_s(self, seconds: list[float]) -> float:
        return makespan(seconds, self.req.workers) + ROUND_OVERHEAD_S * self.req.cal.speed if seconds else 0.0

    def stages(self, s: _State) -> dict[str, float]:
        """Each stage's predicted seconds for the state `s`."""
        r = self.req
        runs = [self.run_s(n, s.depth, s.steps) for n in self.order[: s.n]]
        dear = sorted(runs)[-s.finalists :] if s.finalists else []
        per = self.n_lrs(s) * self.n_seeds(s) - 1
        out = {
            "screen": s.n * self.screen_s(s.width) if r.screen else 0.0,
            "stress": self.round_s(runs),
            "final": self.round_s(dear * per),
            "extend": self.round_s(dear * self.n_seeds(s)) if s.extend else 0.0,
        }
        if s.ladder:
            out["ladder"] = self.ladder_s(s)
        if self.vstage:
            pricing = VerifyPricing(
                self.order[: s.n], r.user, r.cal, r.workers, s.depth, s.steps, r.optimizer, r.ns_steps
            )
            k, width = self.vstage
            out["verify"] = pricing.seconds(min(k, s.n), width)
        return out

    def fits(self, s: _State) -> bool:
        return sum(self.stages(s).values()) <= self.usable

    def smallest(self) -> _State:
        """The smallest answer that fits, largest first: the standard proxy, then shallower, then shorter
        ones; where none fits, `BudgetTooSmall` with the least budget that would do."""
        r, user = self.req, self.req.user
        short = [r.steps] if r.steps_fixed else [r.steps, max(1, r.steps * 2 // 3)]
        floors = [
            _State(
                n=min(MIN_CANDIDATES, len(self.order)),
                depth=d,
                steps=st,
                # --quick's smallest answer is two seeds of each candidate at the stress learning rate: an
                # effect with an interval needs seed noise measured more than a deeper proxy or a second rate
                finalists=0 if r.screen else min(2, len(self.order)),
                n_lrs=2 if r.screen else 1,
                n_seeds=1 if r.screen else 2,
                extend=False,
                width=self.widths[0],
            )
            for st in short
            for d in sorted((d for d in self.depths if d <= self.standard), reverse=True)
        ]
        if r.screen and not r.seeds and len(self.order) >= 2:
            # every answer carries an interval: the final round's two seeds before a deeper proxy (a floor of full
            # steps and at least SHALLOW_DEPTHS[-1] layers, with the final round and two seeds, where one fits)
            seeded = [
                replace(f, finalists=2, n_seeds=2)
                for f in floors
                if f.steps == r.steps and f.depth >= min(SHALLOW_DEPTHS[-1], self.standard)
            ]
            state = next((f for f in seeded if self.fits(f)), None)
            if state is not None:
                return state
        state = next((f for f in floors if self.fits(f)), None)
        if state is not None:
            return state
        least = floors[-1]
        need = (sum(self.stages(least).values()) / FILL + self.reserve) / 60
        minutes = math.ceil(need * 10) / 10 if need < 10 else math.ceil(need)
        more = [f"--budget {minutes:g} or more"]
        if r.steps_fixed:
            more.append("fewer --steps")
        if r.depth and r.depth > min(user.n_layers, SHALLOW_DEPTHS[0]):
            more.append(f"a shallower --depth (at least {min(user.n_layers, SHALLOW_DEPTHS[0])})")
        if r.screen:
            what = (
                f"{least.n} candidates screened at your depth {user.n_layers} and trained once at {least.depth} "
                f"layers, {least.steps} steps: about {need:.1f} min on this machine, "
                f"{self.stages(least)['screen'] / 60:.1f} of them the screen"
            )
        else:  # --quick: no screen; each candidate trained once, the finalists with a second seed
            which = "each" if least.finalists >= least.n else f"{least.finalists} of them"
            what = (
                f"{least.n} candidates trained at {least.depth} layers, {least.steps} steps, {which} with a second "
                f"seed, no screen (--quick): about {need:.1f} min on this machine"
            )
        used = f"; {r.used_s / 60:.1f} min were used before the plan" if r.used_s >= 3 else ""
        raise BudgetTooSmall(
            f"--budget {r.budget_s / 60:g} min cannot hold the smallest answer ({what}{used}); give "
            + ", or ".join(more)
            + f" ({calibration_used(r.cal)})",
            minutes,
        )

    def set_aside_verify(self, state: _State) -> str:
        """With --verify: the verify stage's k and width set aside before the rounds grow (`self.vstage`);
        returns why a verify stage asked for is not in the plan ("" where it is, or was not asked)."""
        r = self.req
        if not r.verify:
            return ""
        floor_s = sum(self.stages(state).values())
        room = min(VERIFY_SHARE * (self.usable - floor_s), self.usable - floor_s) if floor_s < self.usable else 0.0
        pricing = VerifyPricing(
            self.order[: state.n], r.user, r.cal, r.workers, state.depth, state.steps, r.optimizer, r.ns_steps
        )
        vstage, why, need_s = verify_plan(pricing, room)
        note = ""
        if vstage is None and math.isfinite(need_s):  # too dear: the least budget that buys 2 runs at the first width
            minutes = math.ceil(((floor_s + need_s / VERIFY_SHARE) / FILL + self.reserve) / 60)
            note = (
                f"--verify: this budget buys no verify stage (2 runs at width {verify_widths(r.user)[0]} need about "
                f"{need_s / 60:.1f} min more); recommending without it; --budget {minutes} or more buys it"
            )
        elif vstage is None:
            note = why
        if vstage:  # the verify stage's k and width stay; its cost follows the proxy's depth and steps
            self.vstage = (vstage.k, vstage.width)
        return note

    def essential(self, s: _State) -> list[_State]:
        """The small budget's steps, in order: a final round, a second seed, the standard proxy, up to
        FEW_CANDIDATES candidates, a third finalist."""
        out = []
        # the final round (your placement and the leader) and their second seed come first: every answer
        # carries an interval (the effective speedup's needs seed noise), before the proxy grows or the search widens
        if s.finalists == 0 and s.n >= 2:
            out.append(replace(s, finalists=2))
        if s.finalists and not self.req.seeds and s.n_seeds < 2:
            out.append(replace(s, n_seeds=2))
        if s.steps < self.req.steps:
            out.append(replace(s, steps=self.req.steps))
        if s.depth < self.standard:
            out.append(replace(s, depth=self.depths[self.depths.index(s.depth) + 1]))
        if self.ladder_possible(s):  # the speedup over scale, before the search widens: the wider ladder first
            out += [replace(s, ladder=k) for k in self.req.ladders]
        if s.n < min(FEW_CANDIDATES, len(self.order)):
            out.append(replace(s, n=s.n + 1))
        if s.finalists and s.finalists < min(3, s.n):
            out.append(replace(s, finalists=s.finalists + 1))
        return out

    def rest(self, s: _State) -> list[_State]:
        """Then: every candidate, more finalists, the edge learning rates, deeper proxies, more learning
        rates, a third seed, a wider screen."""
        r, out = self.req, []
        if s.n < len(self.order):
            out.append(replace(s, n=s.n + 1))
        if s.finalists and s.finalists < s.n:
            out.append(replace(s, finalists=s.finalists + 1))
        if s.finalists and not s.extend and not r.lrs:
            out.append(replace(s, extend=True))
        if s.depth != self.depths[-1]:
            out.append(replace(s, depth=self.depths[self.depths.index(s.depth) + 1]))
        if s.finalists and not r.lrs and s.n_lrs < 4:
            out.append(replace(s, n_lrs=s.n_lrs + 1))
        if s.finalists and not r.seeds and s.n_seeds < 3:
            out.append(replace(s, n_seeds=s.n_seeds + 1))
        if s.width != self.widths[-1] and r.screen:
            wider = replace(s, width=self.widths[self.widths.index(s.width) + 1])
            if self.stages(wider)["screen"] <= SCREEN_SHARE * r.budget_s:
                out.append(wider)
        return out

    def ladder_possible(self, s: _State) -> bool:
        """The ladder needs the user's placement and a rival in the final round with two seeds each; the quick
        question is one rung."""
        r = self.req
        return (
            not s.ladder
            and r.screen
            and r.current is not None
            and s.finalists >= 2
            and self.n_seeds(s) >= 2
            and s.steps >= r.steps
        )

    def grow(self, state: _State) -> _State:
        """The small budget's steps, each while it fits; once all are taken, the rest, each while it fits."""
        while (nxt := next((u for u in self.essential(state) if self.fits(u)), None)) is not None:
            state = nxt
        if not self.essential(state):
            while (nxt := next((u for u in self.rest(state) if self.fits(u)), None)) is not None:
                state = nxt
        return state

    def plan(self, state: _State, note: str) -> Plan:
        """The `Plan` of the grown `state`: its learning rates, seeds, predicted seconds and cuts."""
        r = self.req
        chosen_lrs = sorted(r.lrs) if r.lrs else list(LRS[state.n_lrs])
        if r.stress_lr not in chosen_lrs:
            chosen_lrs = sorted(chosen_lrs[1:] + [r.stress_lr])
        chosen_seeds = list(r.seeds) if r.seeds else [r.seed0 + i for i in range(state.n_seeds)]
        if not state.finalists:
            chosen_lrs, chosen_seeds = [r.stress_lr], [r.seed0]
        predicted = self.stages(state)
        predicted["reserves"] = self.reserve - self.used
        predicted["used"] = self.used  # before the plan (imports, reading the model, measuring this machine)
        predicted["total"] = sum(predicted.values())
        vstage = None
        if self.vstage:
            k, width = self.vstage
            vstage = VerifyStagePlan(min(k, state.n), width, state.depth, state.steps, r.seed0, predicted["verify"])
        rungs = None
        if state.ladder:
            widths = ladder.LADDERS[state.ladder - 1]
            steps = {str(w): ladder.rung_steps(w, state.steps) for w in ladder.off_proxy(widths)}
            rungs = LadderPlan(list(widths), steps, predicted["ladder"])
        plan = Plan(
            order=self.order,
            screened=self.order[: state.n],
            screen_width=state.width,
            depth=state.depth,
            steps=state.steps,
            stress_lr=r.stress_lr,
            seed0=r.seed0,
            finalists=state.finalists,
            lrs=chosen_lrs,
            seeds=chosen_seeds,
            extend=state.extend,
            predicted=predicted,
            budget_s=r.budget_s,
            workers=r.workers,
            optimizer=r.optimizer,
            verify=vstage,
            verify_note=note,
            screen=r.screen,
            ladder=rungs,
        )
        cut = _cuts(plan, r.user, bool(r.lrs), bool(r.seeds), r.depth is not None, r.steps)
        return replace(plan, cut=self.priced_cuts(state, cut))

    def priced_cuts(self, state: _State, cut: list[str]) -> list[str]:
        """The plan's cuts (`_cuts`) with the budget that would buy the ladder (where it was left out) and a
        second seed of each finalist (where one seed was bought)."""
        r = self.req
        if r.screen and r.current is not None and r.ladders and not state.ladder:  # the budget that would buy it
            # the grow order takes the ladder before more candidates or finalists: the least state that holds it
            n = min(state.n, MIN_CANDIDATES)
            full = replace(state, n=n, finalists=min(2, n), n_seeds=max(2, self.n_seeds(state)))
            full = replace(full, steps=r.steps, depth=max(state.depth, self.standard))
            needs = [
                (math.ceil((sum(self.stages(replace(full, ladder=k)).values()) / FILL + self.reserve) / 60), k)
                for k in sorted(r.ladders, reverse=True)  # the cheapest first
            ]
            cut = cut + [
                "one rung (the proxy): no speedup over scale ("
                + ", ".join(
                    f"--budget {m:g} buys the ladder at widths " + ", ".join(str(w) for w in ladder.LADDERS[k - 1])
                    for m, k in needs
                )
                + ")"
            ]
        if state.finalists and not r.seeds and state.n_seeds < 2:  # the budget that would buy the interval
            two = replace(state, n_seeds=2)
            need = (sum(self.stages(two).values()) / FILL + self.reserve) / 60
            cut = [
                c + f" (--budget {math.ceil(need):g} buys a second seed of each finalist)"
                if c.startswith("one seed")
                else c
                for c in cut
            ]
        return cut


def _fitting_widths(user: ModelConfig, widths: list[int]) -> list[int]:
    """The screen widths whose float64 model fits SCREEN_MEMORY (counted, nothing built); none: refused."""
    resolved = as_layout("peri").resolve(user.n_layers)
    size = {w: 8 * analytic_params(ModelConfig(**screen_shape(user, w, 64)), resolved).total for w in widths[:1]}
    if size[widths[0]] > SCREEN_MEMORY:
        raise ConfigError(
            f"the screen's model at your depth {user.n_layers} needs {size[widths[0]] / 2**30:.1f} GiB even "
            f"at width {widths[0]} (at most {SCREEN_MEMORY / 2**30:.0f} GiB): a model this deep or this "
            f"wide (FFN {user.ffn_dim}) is beyond what recommend screens on this machine"
        )
    return [
        w
        for w in widths
        if 8 * analytic_params(ModelConfig(**screen_shape(user, w, 64)), resolved).total <= SCREEN_MEMORY
    ]


def _check_proxy_memory(user: ModelConfig, depth: int, workers: int) -> None:
    """Refuse proxies whose AdamW training (16 bytes a parameter, twice for activations and slack) would
    not fit this machine's memory with `workers` side by side."""
    params = analytic_params(ModelConfig(**proxy_shape(user, depth)), as_layout("peri").resolve(depth)).total
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = 32 * params * workers
    if need > ram:
        raise ConfigError(
            f"the proxies of your model ({params / 1e6:,.0f}M parameters at width 64: FFN {user.ffn_dim} "
            f"is {user.ffn_dim / user.d_model:,.0f}x your width {user.d_model}) need about "
            f"{need / 2**30:.0f} GiB for {workers} run(s) side by side; this machine has "
            f"{ram / 2**30:.0f} GiB"
        )


def _cuts(p: Plan, user: ModelConfig, lrs_fixed: bool, seeds_fixed: bool, depth_fixed: bool, steps: int) -> list[str]:
    """What the budget left out of the fullest answer, in words (the recommendation states them)."""
    out = []
    if p.steps < steps:
        out.append(f"proxies of {p.steps} steps (asked: {steps})")
    if len(p.screened) < len(p.order):
        out.append(
            f"{len(p.screened)} of {len(p.order)} candidates, chosen by a cheap screen (Kan's step 1 from the "
            f"layout data: one family in turn, bounded / tangential / unbounded); not tried: "
            + ", ".join(p.order[len(p.screened) :])
        )
    if not p.finalists:
        out.append("no final round: one run per candidate, at the stress learning rate only")
    elif p.finalists < len(p.screened):
        out.append(f"a final round for {p.finalists} of {len(p.screened)} candidates")
    if p.finalists and not seeds_fixed and len(p.seeds) < 2:
        out.append("one seed: no seed noise measured")
    if p.finalists and not lrs_fixed and len(p.lrs) < 4:
        out.append(f"{len(p.lrs)} learning rates ({', '.join(f'{x:g}' for x in p.lrs)})")
    if p.depth < user.n_layers and not depth_fixed:
        out.append(f"proxies {p.depth} layers deep (yours: {user.n_layers})")
    if not p.screen:
        out.append("no screen (--quick): the candidates given, trained at once")
    elif p.screen_width < user.d_model:
        out.append(f"the screen at width {p.screen_width} (yours: {user.d_model})")
    return out


def finalists_from(order: list[str], k: int, keep: str | None) -> list[str]:
    """The final round's `k` candidates: the best of the stress round's `order`, `keep` (the current
    placement) always in, in place of the last."""
    names = order[:k]
    if keep in order and keep not in names and names:
        names = names[:-1] + [keep]
    return names
