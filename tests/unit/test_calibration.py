"""`normlab recommend`'s calibration (normlab.recommend.planning.cost) keeps the fastest honest measurement of this
machine: a measurement taken under a load is replaced by a faster one, finished runs that ran faster lower it
(never raise it), and a budget refusal names the calibration it was priced with and how to measure again. The
timers and the measurements are planted: nothing here is timed."""

import json
import math
import os
from dataclasses import replace

import pytest

from normlab.cli import main
from normlab.config.train import TrainConfig
from normlab.model.config import ModelConfig
from normlab.recommend.planning import cost, from_runs, plan
from normlab.recommend.planning.shape import proxy_shape, read_user_model
from normlab.runs.summary import RunSummary

QUIET = lambda *a, **k: None
MEASURED_AT = 1764000000.0  # 2025-11-24 16:00 UTC
# the six timings `fit` takes (pre2, pre6, peri6 steps; screens of 1 and 3 layers at width 64, 1 at 256), as
# an idle machine gives them: the fit's rates are exact for these (a line through them)
IDLE = {"pre2": 0.02, "pre6": 0.05, "peri6": 0.06, "screen1": 0.2, "screen3": 0.4, "screen1_w256": 0.5}


def measured(timings: dict[str, float], at: float = MEASURED_AT) -> cost.Calibration:
    """What `cost.measure` returns for these timings, measured at `at`."""
    cal = cost.fit(*(timings[k] for k in cost.TIMINGS), seconds=4.0, key=cost.machine_key(1))
    return replace(cal, measured_at=at)


def plant(cal: cost.Calibration) -> cost.Calibration:
    """`cal` in this machine's cache file (threads 1: one worker a core), as `calibration` writes it."""
    path = cost.cache_file(cost.machine_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in cal.to_dict().items() if k != "c_stream"}))
    return cal


def cached() -> cost.Calibration:
    got = cost.cached_calibration(cost.cache_file(cost.machine_key(1)))
    assert got is not None
    return got


def test_each_timing_is_the_fastest_repeat_and_the_lesser_of_cpu_and_wall_time(monkeypatch):
    """`_fastest`: one untimed warm-up, then the least over the repeats of min(wall, CPU) seconds. Planted
    clocks: a repeat of 5 s wall / 1 s CPU (a loaded machine: waiting for a core), of 2 s wall / 4 s CPU (two
    threads: CPU time counts both), of 3 s / 3 s: 1 s."""
    clocks = {"wall": 100.0, "cpu": 50.0}
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clocks["wall"])
    monkeypatch.setattr(cost.time, "process_time", lambda: clocks["cpu"])
    calls = iter([(1000.0, 1000.0), (5.0, 1.0), (2.0, 4.0), (3.0, 3.0)])  # the warm-up's first: never counted

    def step() -> None:
        wall, cpu = next(calls)
        clocks["wall"] += wall
        clocks["cpu"] += cpu

    assert cost._fastest(step, 3) == 1.0
    calls = iter([(0.1, 0.1), (7.0, 6.0), (2.5, 9.0)])
    assert cost._fastest(step, 2) == 2.5


def test_a_cached_slow_calibration_is_replaced_by_a_faster_measurement(monkeypatch):
    """Measured under a load (every timing 4x, as the 17.3x refusals of issue 51), then --recalibrate on an idle
    machine: each timing the faster of the two, refit; the cache file holds it, named "the fastest of 2
    measurements". Measured again while busy (4.5x): the faster cached one is kept. Without --recalibrate the cache is
    read and nothing measured."""
    busy = plant(measured({k: 4 * t for k, t in IDLE.items()}))
    idle = measured({**IDLE, "screen3": 2 * busy.measured["screen3"]}, at=MEASURED_AT + 86400)  # one timing slower
    runs: list[cost.Calibration] = [idle]
    monkeypatch.setattr(cost, "measure", lambda threads=1: runs.pop(0))
    said: list[str] = []
    cal, was_cached = cost.calibration(1, log=said.append, streams=False)
    assert was_cached and cal == busy and runs == [idle]  # read, not measured
    cal, was_cached = cost.calibration(1, log=said.append, streams=False, remeasure=True)
    assert not was_cached and runs == [] and "measuring this machine again" in said[-1]
    want = {k: min(4 * t, idle.measured[k]) for k, t in IDLE.items()}
    assert cal.measured == pytest.approx(want) and want["screen3"] == 4 * IDLE["screen3"]  # the cached one, faster
    assert cal.speed == pytest.approx(busy.speed / 4) and cal.c0 == pytest.approx(busy.c0 / 4)
    assert cal.measurements == 2 and cal.measured_at == MEASURED_AT + 86400
    assert cached() == cal and "(the fastest of 2 measurements)" in cal.describe()
    # measured once more on a busy machine: nothing it timed is faster, the cached calibration stays
    runs.append(measured({k: 4.5 * t for k, t in IDLE.items()}, at=MEASURED_AT + 2 * 86400))
    again, _ = cost.calibration(1, log=QUIET, streams=False, remeasure=True)
    assert again.speed == pytest.approx(cal.speed) and again.measured == pytest.approx(cal.measured)
    assert again.measurements == 3 and cached() == again


def test_a_budget_refusal_names_the_calibration_and_how_to_measure_again(tmp_path, capsys, monkeypatch):
    """The refusal of a budget too small for the smallest answer ends with the calibration that priced it (how
    fast against the reference VM, when measured, its cache file) and how to measure again (--recalibrate, or
    deleting the file); `normlab recommend --recalibrate` then measures, keeps the faster and prices with it."""
    slow = plant(measured({k: 17.3 * t for k, t in IDLE.items()}))  # a calibration measured on a loaded machine
    path = cost.cache_file(cost.machine_key(1))
    user = read_user_model("micro").config
    with pytest.raises(plan.BudgetTooSmall) as err:
        plan.make_plan(["pre", "peri", "post"], "pre", user, cached(), 60, 2, 150)
    text = str(err.value)
    assert (
        f"priced with this machine's calibration: {slow.speed:.2f}x the reference VM's step time, measured "
        f"2025-11-24 16:00 UTC; cached in {path}; if the machine was busy then, measure it again: "
        f"normlab recommend ... --recalibrate (keeps the faster) or delete {path})"
    ) in text
    assert text.index(f"give --budget {err.value.minutes:g} or more") < text.index("priced with")

    out = tmp_path / "r"
    workers = str(os.cpu_count() or 1)  # a worker a core: the calibration of 1 thread, the one planted
    args = [
        "recommend",
        "micro",
        "--budget",
        "1",
        "--workers",
        workers,
        "--candidates",
        "pre,peri,post",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(cost, "measure", lambda threads=1: pytest.fail("the cached calibration is measured again"))
    assert main(args) == 2
    err_line = capsys.readouterr().err.strip()
    assert len(err_line.splitlines()) == 1 and "cannot hold the smallest answer" in err_line
    assert f"{slow.speed:.2f}x the reference VM's step time, measured 2025-11-24 16:00 UTC" in err_line
    assert "--recalibrate" in err_line and f"delete {path}" in err_line and not out.exists()
    # --recalibrate on an idle machine: the faster measurement is kept, and the plan is priced with it
    monkeypatch.setattr(cost, "measure", lambda threads=1: measured(IDLE, at=MEASURED_AT + 3600))
    monkeypatch.setattr(cost, "measure_streams", lambda *a, **k: pytest.fail("no candidate has streams"))
    assert main([*args[:3], "0.1", *args[4:], "--recalibrate"]) == 2  # 6 s: below even an idle machine's least
    err_line = capsys.readouterr().err.strip()
    fast = cached()
    assert fast.speed == pytest.approx(slow.speed / 17.3) and fast.measurements == 2
    assert f"{fast.speed:.2f}x the reference VM's step time, measured 2025-11-24 17:00 UTC (the fastest of 2" in (
        err_line
    )
    assert "cannot hold the smallest answer" in err_line and not out.exists()  # priced with the faster one


def _steps(cal: cost.Calibration, ratios: list[float]) -> list[from_runs.RunStep]:
    """Finished runs of the recommend proxy (12 layers of a 1B Llama's shape, 16 x 128 tokens) whose median
    steps took `ratios` x what `cal` predicts."""
    shape = ModelConfig(**proxy_shape(ModelConfig(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8), 12))
    layouts = ["pre", "peri", "post", "pre-mhc"]
    return [
        from_runs.RunStep(shape, layouts[i % 4], r * cal.step_seconds(shape, layouts[i % 4]))
        for i, r in enumerate(ratios)
    ]


def test_runs_faster_than_predicted_lower_the_cached_rates():
    """Runs' steps at 0.5, 0.55 and 0.7 of the prediction (median 0.55): the training rates, the step timings
    behind them and the speed scale by 0.55; the screens at half theirs halve the screen's rates; the stream rates
    (a share of Pre-LN's step) follow. The refusal's words say it was lowered by runs."""
    cal = plant(measured({k: 2 * t for k, t in IDLE.items()}))
    stream_file = cost.stream_cache_file(cost.machine_key(1))
    stream_file.write_text(json.dumps({"c_stream": {}, "measured": {"pre6": 0.1, "hc": 0.2, "mhc": 0.3}}))
    before, _ = cost.calibration(1, log=QUIET)
    screen = ModelConfig(**{**cost._screen_shape(64, 12).to_dict()})
    said: list[str] = []
    got = from_runs.refresh_from_runs(
        1, _steps(cal, [0.5, 0.7, 0.55]), [(screen, 0.5 * cal.screen_seconds(screen))], log=said.append, when=7.0
    )
    assert got is not None and cached() == got
    assert (got.c0, got.c_flop, got.c_norm) == pytest.approx((0.55 * cal.c0, 0.55 * cal.c_flop, 0.55 * cal.c_norm))
    assert (got.s0, got.s_layer, got.s_flop) == pytest.approx((0.5 * cal.s0, 0.5 * cal.s_layer, 0.5 * cal.s_flop))
    assert got.speed == pytest.approx(0.55 * cal.speed) and got.runs_factor == pytest.approx(0.55) and got.runs_at == 7
    assert got.measured == pytest.approx(
        {k: (0.55 if k in cost.STEP_TIMINGS else 0.5) * t for k, t in cal.measured.items()}
    )
    assert cost.fit(*(got.measured[k] for k in cost.TIMINGS)).c0 == pytest.approx(got.c0)  # the timings still fit it
    assert "3 proxy runs' steps took 0.55x and the screens 0.50x of what it predicted" in said[0]
    after, _ = cost.calibration(1, log=QUIET)
    assert after.c_stream == pytest.approx({m: 0.55 * r for m, r in before.c_stream.items()})
    assert "lowered to 0.55x of that by proxy runs that ran faster (1970-01-01 00:00 UTC)" in got.describe()
    # a run's step from what it recorded: tokens a step over its median tokens a second, on the CPU, finished
    config = TrainConfig.of(size="micro-deep", layout="peri", batch_size=4, seq_len=32, optimizer="muon")
    step = from_runs.run_step(config, RunSummary.from_json({"status": "stalled", "device": "cpu", "tok_per_s": 1280.0}))
    assert step == from_runs.RunStep(config.model.config, "peri", 4 * 32 / 1280.0, 128, 32, "muon", 5)
    for summary in (
        {"status": "diverged", "device": "cpu", "tok_per_s": 1280.0},  # its last steps are not a step's work
        {"status": "ok", "device": "cuda:0", "tok_per_s": 1e6},  # not what a CPU calibration measures
        {"status": "ok", "device": "cpu", "tok_per_s": math.nan},
        None,
    ):
        assert from_runs.run_step(config, None if summary is None else RunSummary.from_json(summary)) is None


def test_runs_on_a_busy_machine_never_raise_the_calibration():
    """Runs slower than predicted (a busy machine), or faster by less than 10%, or one fast run among slow ones
    (the median decides): the cache file is left byte for byte, nothing said."""
    cal = plant(measured(IDLE))
    path = cost.cache_file(cost.machine_key(1))
    before = path.read_bytes()
    screen = ModelConfig(**cost._screen_shape(64, 12).to_dict())
    said: list[str] = []
    for ratios, screen_ratio in (([1.5, 3.0, 0.95], 4.0), ([0.95, 0.92], 0.93), ([0.2, 1.4, 1.6], 1.0), ([], 1.2)):
        screens = [(screen, screen_ratio * cal.screen_seconds(screen))]
        assert from_runs.refresh_from_runs(1, _steps(cal, ratios), screens, log=said.append) is None
        assert path.read_bytes() == before
    assert said == []
    assert from_runs.lowered(cal, [2.0, 5.0], [3.0], when=1.0) is None  # the rule itself: never a raise
    low, step, screen_scale = from_runs.lowered(cal, [0.5], [2.0], when=1.0)
    assert (step, screen_scale) == (0.5, 1.0) and low.s0 == cal.s0 and low.c0 == pytest.approx(0.5 * cal.c0)


@pytest.mark.parametrize(
    "edit, why",
    [
        ({k: 0.0 for k in ("c0", "c_flop", "c_norm", "s0", "s_layer", "s_flop")}, "its step is 0x"),
        ({"c_flop": 1e308}, "x the reference VM's"),
        ({"c0": 1e-12, "c_flop": 1e-20, "c_norm": 0.0}, "x the reference VM's"),  # a step 1e5x faster than any machine
        ({"s0": 5e3}, "a 1-layer screen takes"),
        ({"c_norm": math.nan}, "c_norm is nan"),
        ({"measurements": 0}, "measurements is 0"),
    ],
)
def test_a_cache_file_that_is_not_a_measurement_is_said_and_measured_again(monkeypatch, edit, why):
    """Issue 63 item 21: a calibration file with every rate 0 (every budget fits), c_flop = 1e308 (none does), a
    NaN rate (a raw ValueError at the plan) is no measurement of a machine: said in one line, measured again, and
    the new measurement replaces the file."""
    path = cost.cache_file(cost.machine_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**measured(IDLE).to_dict(), **edit}))  # NaN written as JSON's NaN
    assert cost.cached_calibration(path) is None
    fresh = measured(IDLE, at=MEASURED_AT + 60)
    monkeypatch.setattr(cost, "measure", lambda threads=1: fresh)
    said: list[str] = []
    cal, was_cached = cost.calibration(1, log=said.append, streams=False)
    assert cal == fresh and not was_cached and cached() == fresh
    assert f"the cached calibration in {path} is not a measurement of a machine (" in said[0] and why in said[0]


def test_stream_rates_out_of_range_are_ignored_and_priced_at_the_reference_ratios(monkeypatch):
    """A stream cache whose rate is NaN, negative or a step 1e6x Pre-LN's is not read: the mix is priced at the
    reference VM's ratio (`REFERENCE_STREAM_RATIOS`) and counted as not measured; a valid mix beside it is read."""
    cal = plant(measured(IDLE))
    spath = cost.stream_cache_file(cost.machine_key(1))
    for bad in (math.nan, -1.0, 1e6):
        spath.write_text(json.dumps({"ratio": {"hc": bad, "mhc": 2.0}}))
        got, missing = cost.stream_rates(cached())
        assert missing == {"hc"}
        assert cost.stream_ratios(got) == pytest.approx({"hc": cost.REFERENCE_STREAM_RATIOS["hc"], "mhc": 2.0})
    spath.write_text(json.dumps({"c_stream": {"hc": math.nan, "mhc": 1e300}}))  # the oldest form: rates alone
    got, missing = cost.stream_rates(cal)
    assert missing == {"hc", "mhc"} and cost.stream_ratios(got) == pytest.approx(cost.REFERENCE_STREAM_RATIOS)


def test_recommend_on_a_nan_calibration_measures_again_and_refuses_a_small_budget_in_one_line(
    tmp_path, capsys, monkeypatch
):
    """Issue 63 item 21 end to end: a NaN rate in the cache made recommend exit 1 with a raw ValueError; now the
    file is measured again and the budget refusal is the usual one line, exit 2."""
    path = cost.cache_file(cost.machine_key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**measured(IDLE).to_dict(), "c0": math.nan}))
    monkeypatch.setattr(cost, "measure", lambda threads=1: measured(IDLE))
    args = [
        "recommend",
        "micro",
        "--budget",
        "0.1",
        "--workers",
        str(os.cpu_count() or 1),
        "--out",
        str(tmp_path / "r"),
    ]
    assert main([*args, "--candidates", "pre,peri,post"]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "cannot hold the smallest answer" in captured.err
    assert "is not a measurement of a machine (c0 is nan" in captured.out and cached() == measured(IDLE)


def test_two_calls_on_one_machine_keep_each_others_faster_timings():
    """Issue 63 item 6: a call writes its calibration while another call has written one since it read the cache:
    the file keeps each timing's faster (refit), never the last writer's alone; written whole (a temporary file
    renamed over it: nothing else is left in the folder); writing the same calibration again changes nothing.
    The stream rates likewise keep each mix's faster ratio."""
    path = cost.cache_file(cost.machine_key(1))
    mine = measured({**IDLE, "pre2": 0.5 * IDLE["pre2"], "screen3": 3 * IDLE["screen3"]}, at=MEASURED_AT + 10)
    theirs = plant(measured({**IDLE, "pre6": 0.8 * IDLE["pre6"]}))  # the other call's, written meanwhile
    out = cost.store_calibration(path, mine)
    want = {**IDLE, "pre2": 0.5 * IDLE["pre2"], "pre6": 0.8 * IDLE["pre6"]}
    assert cached() == out and out.measured == pytest.approx(want) and out.measured_at == MEASURED_AT + 10
    refit = cost.fit(*(want[k] for k in cost.TIMINGS))
    assert (out.c0, out.c_flop, out.s_layer) == pytest.approx((refit.c0, refit.c_flop, refit.s_layer))
    assert theirs.measured["pre2"] == IDLE["pre2"]
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.name + ".lock"])
    before = path.read_bytes()
    assert cost.store_calibration(path, out) == out and path.read_bytes() == before  # idempotent
    # the stream rates: each mix's faster ratio of the cached and the new
    spath = cost.stream_cache_file(cost.machine_key(1))
    spath.write_text(json.dumps({"ratio": {"hc": 2.0}}))
    measure_streams = cost.measure_streams
    try:
        cost.measure_streams = lambda threads=1, mixes=cost.STREAM_MIXES, cap_s=0: (0.1, {"hc": 0.3, "mhc": 0.25})
        got = cost.measure_stream_rates(out, 1, ("hc", "mhc"), log=QUIET)
    finally:
        cost.measure_streams = measure_streams
    assert json.loads(spath.read_text())["ratio"] == pytest.approx({"hc": 2.0, "mhc": 2.5})
    assert cost.stream_ratios(got) == pytest.approx({"hc": 2.0, "mhc": 2.5})


def test_every_measurement_is_bounded_by_its_time_cap(monkeypatch):
    """Issue 63 item 5: no repeat starts past a timing's deadline: the fastest so far is kept, the warm-up's
    where no repeat started (an upper bound: a plan priced larger, never smaller); the six timings share the
    cap, one deadline after another; the stream mixes measured are those asked for, no others."""
    clocks = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clocks["wall"])
    monkeypatch.setattr(cost.time, "process_time", lambda: clocks["cpu"])

    def taking(seconds: list[float]):  # each call's seconds, the clocks from 0
        it = iter(seconds)
        clocks.update(wall=0.0, cpu=0.0)

        def step() -> None:
            t = next(it)
            clocks["wall"] += t
            clocks["cpu"] += t

        return step

    assert cost._fastest(taking([9.0]), 5, deadline=5.0) == 9.0  # the warm-up ran past it: its time, no repeat
    assert cost._fastest(taking([2.0, 3.0, 1.0]), 5, deadline=4.0) == 3.0  # one repeat started before it
    assert cost._fastest(taking([2.0, 3.0, 1.0, 1.5, 1.5, 1.5]), 5) == 1.0  # no deadline: all 5 repeats
    assert cost._shares(10.0, 60.0, 6) == pytest.approx([20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
    timed: list[str] = []
    monkeypatch.setattr(cost, "_step_time", lambda layout, n, deadline=math.inf: timed.append(layout) or 0.1)
    pre6, mixes = cost.measure_streams(1, ("mhc",))
    assert timed == ["pre", "pre,streams=4,mix=mhc"] and set(mixes) == {"mhc"}
