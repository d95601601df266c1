"""Effective speedup of candidates against a baseline, from finished sweep folders, by recommend's own formula
(`normlab.recommend.evidence.speedup.for_pair`: the tokens the baseline needs to reach the candidate's final loss on its
seeds' mean loss curve, over the candidate's tokens, divided by 1 + the norm tax; marin's unit).

    python scripts/sweep_speedup.py SWEEP [SWEEP ...] --base pre@3e-3 \\
        --cand pre-gatednorm@3e-2:26.8:17.7:36.7 [--cand NAME@LR[:TAX:LO:HI] ...]

Each side is NAME@LR, the cell (layout at that learning rate) read from every SWEEP's runs; a candidate may add its
norm tax against the baseline and the tax's interval, in percent (`benchmarks/norm_tax.py`); without one the
speedup is in tokens alone.
"""

import argparse
from pathlib import Path
from types import SimpleNamespace

from normlab.recommend.evidence import speedup


def _side(text: str) -> tuple[SimpleNamespace, dict | None]:
    cell, *tax = text.split(":")
    name, lr = cell.rsplit("@", 1)
    side = SimpleNamespace(layout=name, best_lr=float(lr))
    if not tax:
        return side, None
    value, lo, hi = (float(t) / 100 for t in tax)
    return side, {"value": value, "interval": [lo, hi]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", type=Path, nargs="+")
    p.add_argument("--base", required=True, help="NAME@LR")
    p.add_argument("--cand", action="append", required=True, help="NAME@LR[:TAX:LO:HI], the tax in percent")
    args = p.parse_args()
    runs = speedup.gathered(args.sweeps)
    if runs is None:
        raise SystemExit(f"no sweep store in {', '.join(map(str, args.sweeps))}")
    base, _ = _side(args.base)
    for text in args.cand:
        cand, tax = _side(text)
        s = speedup.for_pair(runs, args.sweeps[0], base, cand, tax, 0, 0)
        shown = speedup.words(s) if s.get("value") is not None else s.get("why")
        print(f"{cand.layout} at lr {cand.best_lr:g} vs {base.layout} at lr {base.best_lr:g}: {shown}")


if __name__ == "__main__":
    main()
