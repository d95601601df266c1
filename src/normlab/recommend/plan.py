"""How `normlab recommend` spends its budget: the screen's width, then the proxy grid in two rounds
(successive halving), from costs measured on this machine before anything long starts.

1. The screen gets `SCREEN_SHARE` of the budget; its width is the user's own where that fits, else the
   largest power of two that does (screen time grows as a + b d^2, fit on two measured widths), its
   float64 model within SCREEN_MEMORY.
2. The stress round trains every candidate once at the stress learning rate (the top of `LRS`: 0.1,
   where Pre-LN's fp16 failure appears at proxy scale), seed 0. Its depth is the user's where the
   budget allows both rounds (this one, and a final round for `MIN_FINALISTS`), else the deepest of
   `DEPTHS` that does, never below `MIN_DEPTH` (or the user's own, when shallower). Where even that
   does not fit, the candidates the screen likes least are left out (never the user's current
   placement); a budget too small for three is refused with the budget that would do.
3. The final round (`plan_finals`, after the stress round, on its measured run times): the best
   candidates of the stress round (the user's current placement always among them) get the learning
   rates x seeds grid, two by two at least; as many finalists as the time left holds, then more
   learning rates, then a third seed.

A run's time is `RUN_OVERHEAD_S + steps * step_s * STEP_FACTOR` (start-up, probes, evaluation and
checkpoints measured on the 2-core VM: a 12-layer Peri-LN proxy of 150 steps takes 49 s, its bare
training step 0.275 s); a round's time is its runs' total over the workers plus one run (the tail).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

LRS = {2: (1e-2, 1e-1), 3: (1e-2, 3e-2, 1e-1), 4: (3e-3, 1e-2, 3e-2, 1e-1)}  # log-spaced, up to the stress lr
DEPTHS = (64, 48, 32, 24, 16, 12)
MIN_DEPTH = 12
MIN_CANDIDATES = 3
MIN_FINALISTS = 3
RUN_OVERHEAD_S = 8.0
STEP_FACTOR = 1.25
SCREEN_SHARE = 0.2
REPORT_RESERVE_S = 20.0  # the summaries, the figures and the report
SCREEN_MEMORY = 4 * 2**30  # the screen's float64 model at most this large
CALIBRATION_BATCH, CALIBRATION_SEQ = 16, 128


class BudgetTooSmall(ValueError):
    """The budget cannot hold the smallest grid; `need_s`: the proxy runs' seconds that would do."""

    def __init__(self, message: str, need_s: float) -> None:
        super().__init__(message)
        self.need_s = need_s


def run_seconds(step_s: float, steps: int) -> float:
    return RUN_OVERHEAD_S + steps * step_s * STEP_FACTOR


def round_seconds(run_s: list[float], workers: int) -> float:
    """A round's wall time: its runs over the workers, plus the longest run (the last one's tail)."""
    return sum(run_s) / workers + max(run_s, default=0.0)


def depths_for(user_depth: int) -> list[int]:
    """The proxy depths to try, deepest first: the user's, then the shallower of `DEPTHS`, down to
    MIN_DEPTH (or the user's own, when shallower)."""
    floor = min(user_depth, MIN_DEPTH)
    return [user_depth] + [d for d in DEPTHS if floor <= d < user_depth]


@dataclass
class StressPlan:
    """The stress round: who, at what depth, and the estimate behind it."""

    candidates: list[str]
    depth: int
    seconds: float  # both rounds' estimate at the smallest final round
    dropped: dict[str, str] = field(default_factory=dict)  # candidate -> why it is not trained

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_stress(step_s: dict[str, float], calib_depth: int, user_depth: int, steps: int, seconds: float,
                workers: int, keep: str | None = None, final_runs: int = 3, depth: int | None = None) -> StressPlan:
    """The stress round for candidates in the screen's order (best first; `step_s`: each one's measured
    training step at `calib_depth` layers), such that it and a final round of MIN_FINALISTS candidates
    with `final_runs` more runs each fit `seconds`. `depth`: the proxy depth the user fixed (candidates
    are left out instead of layers)."""
    depths = [depth] if depth else depths_for(user_depth)
    def cost(names: list[str], depth: int) -> float:
        runs = {n: run_seconds(step_s[n] * depth / calib_depth, steps) for n in names}
        finals = sorted(runs.values())[-min(MIN_FINALISTS, len(names)):] * final_runs  # the dearest finalists
        return round_seconds(list(runs.values()), workers) + round_seconds(finals, workers)

    names = list(step_s)
    while True:
        for d in depths:
            if cost(names, d) <= seconds:
                dropped = {n: "the budget (the screen liked it least)" for n in step_s if n not in names}
                return StressPlan(names, d, cost(names, d), dropped)
        droppable = [n for n in reversed(names) if n != keep]
        if len(names) <= min(MIN_CANDIDATES, len(step_s)) or not droppable:
            break
        names.remove(droppable[0])
    floor = depths[-1]
    need = cost(names, floor)
    raise BudgetTooSmall(f"the budget leaves {seconds / 60:.1f} min for the proxy runs; the smallest grid ({len(names)} "
                         f"candidates at {floor} layers, {steps} steps, {MIN_FINALISTS} finalists) needs about "
                         f"{need / 60:.1f} min", need)


@dataclass
class FinalPlan:
    finalists: list[str]
    lrs: list[float]
    seeds: list[int]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_finals(order: list[str], run_s: dict[str, float], seconds: float, workers: int, stress_lr: float,
                seed0: int, keep: str | None = None, lrs: tuple[float, ...] = (), seeds: tuple[int, ...] = ()
                ) -> FinalPlan:
    """The final round: finalists from the stress round's `order` (best first; `keep` always in), each with
    the learning rates x seeds grid minus the run it has; `run_s`: each candidate's run time as measured."""
    def cost(names: list[str], n_lrs: int, n_seeds: int) -> float:
        return round_seconds([run_s[n] for n in names] * (n_lrs * n_seeds - 1), workers) if names else 0.0

    def pick(k: int) -> list[str]:
        names = order[:k]
        if keep in order and keep not in names:
            names = names[:-1] + [keep] if names else [keep]
        return names

    lr_options = [len(lrs)] if lrs else sorted(LRS)
    seed_options = [len(seeds)] if seeds else [2, 3]
    n_lrs, n_seeds = lr_options[0], seed_options[0]
    k = len(order)
    while k > 1 and cost(pick(k), n_lrs, n_seeds) > seconds:
        k -= 1
    if cost(pick(k), n_lrs, n_seeds) > seconds:
        if not seeds:
            n_seeds = 1
        if cost(pick(k), n_lrs, n_seeds) > seconds:
            return FinalPlan([], [], [], 0.0)  # no time for a final round: the stress round is the evidence
    if k == len(order):  # everyone is in: more learning rates, then a third seed
        while n_lrs < lr_options[-1] and cost(pick(k), n_lrs + 1, n_seeds) <= seconds:
            n_lrs += 1
        if n_seeds < seed_options[-1] and cost(pick(k), n_lrs, n_seeds + 1) <= seconds:
            n_seeds += 1
    chosen_lrs = sorted(lrs) if lrs else list(LRS[n_lrs])
    if stress_lr not in chosen_lrs:
        chosen_lrs = sorted(chosen_lrs[1:] + [stress_lr])
    chosen_seeds = list(seeds) if seeds else [seed0 + i for i in range(n_seeds)]
    return FinalPlan(pick(k), chosen_lrs, chosen_seeds, cost(pick(k), n_lrs, n_seeds))


def screen_width(user_width: int, per_width: Callable[[int], float], n_candidates: int, seconds: float,
                 params_at: Callable[[int], int]) -> int:
    """The widest screen (the user's own width, else a power of two below it, at least 64) whose
    predicted time for all candidates fits `seconds` and whose float64 model fits SCREEN_MEMORY."""
    widths = [user_width] + [2**k for k in range(16, 5, -1) if 2**k < user_width]
    for w in widths:
        if n_candidates * per_width(w) <= seconds and 8 * params_at(w) <= SCREEN_MEMORY:
            return w
    return min(widths[-1], user_width)


def quadratic(t1: float, w1: int, t2: float, w2: int) -> Callable[[int], float]:
    """t(w) = a + b w^2 through two measured points (b floored at 0)."""
    b = max((t2 - t1) / (w2 * w2 - w1 * w1), 0.0)
    a = t1 - b * w1 * w1
    return lambda w: a + b * w * w


def time_train_step(layout: str, model_options: dict[str, Any], steps: int = 3) -> float:
    """Seconds per AdamW training step of `layout` at `model_options` (batch 16 x 128 bytes, one
    thread, as one sweep worker): the median of `steps` after one warm-up step."""
    import torch

    from normlab.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the trainer runs on a CPU
    try:
        model = build_model(layout, "micro-deep", seed=0, **model_options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, model.config.vocab_size, (CALIBRATION_BATCH, CALIBRATION_SEQ),
                               generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return sorted(times[1:])[len(times[1:]) // 2]
    finally:
        torch.set_num_threads(threads)
