"""Where step metrics go: metrics.jsonl (always), a progress bar (tqdm on a terminal, a line a minute
in a log or pipe), TensorBoard and Weights & Biases (optional extras; ``WANDB_MODE=offline`` works
without a network)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normlab.errors import ConfigError
from normlab.runs.files import RunDir
from normlab.runs.metrics import Metric

if TYPE_CHECKING:
    from normlab.config.train import TrainConfig


class LineProgress:
    """Progress where no terminal is attached: one line on stderr every ``every`` seconds of ``clock`` (and
    at the end), as sweeps log theirs; the same calls as the tqdm bar it replaces. ``clock``: the seconds
    the lines and the ETA are reckoned in (time.monotonic; a test passes its own)."""

    def __init__(
        self, total: int, start: int, name: str, every: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total, self.n, self.name, self.every, self.clock = total, start, name, every, clock
        self.t0 = self.last = clock()
        self.start, self.post = start, ""

    def set_postfix(self, post: dict[str, str], refresh: bool = False) -> None:
        self.post = ", ".join(f"{k} {v}" for k, v in post.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every:
            self._line()

    def _line(self) -> None:
        self.last = self.clock()
        done = self.n - self.start
        eta = (self.last - self.t0) / done * (self.total - self.n) if done else None
        print(
            f"{self.name}: step {self.n}/{self.total}"
            + (f", ETA {eta / 60:.1f} min" if eta is not None else "")
            + (f"; {self.post}" if self.post else ""),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.n > self.start:
            self._line()


class Sinks:
    def __init__(self, cfg: TrainConfig, run: RunDir, start: int) -> None:
        self.tb = self.wandb = self.bar = None
        if cfg.loggers.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "--tensorboard needs the tensorboard package: pip install 'normlab[tensorboard]'"
                ) from None
            self.tb = SummaryWriter(log_dir=str(run.tensorboard_dir), purge_step=start)
        if cfg.loggers.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("--wandb needs the wandb package: pip install 'normlab[wandb]'") from None
            self.wandb = wandb.init(
                project="normlab",
                name=Path(cfg.run.out).name,
                dir=str(run.path),
                config=cfg.to_dict(),
                resume="allow",
                id=Path(cfg.run.out).name,
            )
        if cfg.loggers.progress:
            if sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(
                    total=cfg.optim.steps, initial=start, desc=Path(cfg.run.out).name, unit="step", dynamic_ncols=True
                )
            else:  # a log file or a pipe: a line a minute, not a carriage return per step
                self.bar = LineProgress(cfg.optim.steps, start, Path(cfg.run.out).name)
        # Opened last: a sink that fails to start above leaves no file handle behind.
        self.file = run.metrics_file.open("a", buffering=1)

    def log(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        scalars = {
            k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != Metric.STEP
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row[Metric.STEP])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row[Metric.STEP])
        if self.bar is not None:
            post = {
                Metric.LOSS: f"{row['loss']:.4f}" if math.isfinite(row[Metric.LOSS]) else str(row[Metric.LOSS]),
                Metric.LR: f"{row['lr']:.2e}",
                "tok/s": f"{row['tok_per_s']:.0f}",
            }
            if Metric.VAL_LOSS in row:
                post["val"] = f"{row['val_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def alert(self, step: int, signal: str, text: str) -> None:
        """An early warning (`normlab.diagnostics.early_warning`): a line on stderr, a text event in
        TensorBoard (tag warnings/SIGNAL) and a W&B alert."""
        self.note(text)
        if self.tb is not None:
            self.tb.add_text(f"warnings/{signal}", text, step)
        if self.wandb is not None:
            self.wandb.alert(title=f"normlab: {signal}", text=text)

    def note(self, text: str) -> None:
        """A line about the run while it trains: on stderr, above the progress bar where one is drawn."""
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        if self.file.closed:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
