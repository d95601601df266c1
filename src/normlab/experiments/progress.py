"""Progress of a sweep (and `compare`): one bar over every step of every run, with ETA.

The coordinator does not train; it reads the newest row of each running run's metrics.jsonl every
couple of seconds, so the bar moves with the runs' steps (a run that takes five minutes no longer
shows as one silent line). On a terminal it is a tqdm bar whose postfix holds the counts by status
and the runs in flight ("post 120/300"); elsewhere (a log file, CI) one line every `every` seconds of
`clock` (time.monotonic; a test passes its own), the ETA reckoned on the same clock.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from normlab.runs.files import SweepDir
from normlab.runs.outcome import STOPPED, shown_status


def last_step(metrics: Path) -> int:
    """Steps completed by a run, from the last complete line of its metrics.jsonl (0 if none)."""
    try:
        with metrics.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"]) + 1
        except (ValueError, KeyError, TypeError):
            continue
    return 0


class SweepProgress:
    def __init__(
        self,
        root: Path,
        steps: dict[str, int],
        name: str,
        log: Callable[[str], Any] = print,
        every: float = 60.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root, self.steps, self.log, self.every, self.clock = root, steps, log, every, clock
        self.done: dict[str, int] = {}
        self.running: dict[str, int] = {}
        self.counts = {"ok": 0, "stalled": 0, "diverged": 0, "failed": 0, STOPPED: 0}
        self.t0 = self.last_line = clock()
        tty = sys.stderr.isatty() if tty is None else tty
        self.bar = (
            tqdm(total=sum(steps.values()), desc=f"sweep {name}", unit="step", dynamic_ncols=True, leave=True)
            if tty
            else None
        )

    def started(self, rid: str) -> None:
        self.running[rid] = 0

    def finished(self, rid: str, row: dict[str, Any]) -> None:
        self.running.pop(rid, None)
        self.done[rid] = self.steps.get(rid, 0)  # a diverged or failed run is done with its steps
        status = shown_status(row.get("status", "failed"), row.get("reason"))
        self.counts[status if status in self.counts else "failed"] += 1
        self.refresh()

    def poll(self) -> None:
        for rid in self.running:
            self.running[rid] = min(last_step(SweepDir(self.root).run(rid).metrics_file), self.steps.get(rid, 0))
        self.refresh()

    @property
    def position(self) -> int:
        return sum(self.done.values()) + sum(self.running.values())

    def eta(self) -> float | None:
        pos, total = self.position, sum(self.steps.values())
        spent = self.clock() - self.t0
        return spent / pos * (total - pos) if pos else None

    def describe(self) -> str:
        inflight = ", ".join(f"{rid.rsplit('-', 1)[0]} {s}/{self.steps.get(rid, 0)}" for rid, s in self.running.items())
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)
        return "; ".join(x for x in (counts, inflight) if x)

    def refresh(self) -> None:
        if self.bar is not None:
            self.bar.n = self.position
            self.bar.set_postfix_str(self.describe(), refresh=False)
            self.bar.refresh()
        elif self.clock() - self.last_line >= self.every:
            self.last_line = self.clock()
            eta = self.eta()
            total = sum(self.steps.values())
            self.log(
                f"progress: {len(self.done)}/{len(self.steps)} runs done, {self.position}/{total} steps"
                f"{f', ETA {eta / 60:.1f} min' if eta is not None else ''}; {self.describe()}"
            )

    def write(self, message: str) -> None:
        """A line above the bar (or through `log` when there is no bar)."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
