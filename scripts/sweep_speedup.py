"""Effective speedup of candidates against a baseline, from finished sweep folders, by recommend's own formula
(`normlab.recommend.speedup.for_pair`: the tokens the baseline needs to reach the candidate's final loss on its
seeds' mean loss curve, over the candidate's tokens, divided by 1 + the norm tax; marin's unit).

    python scripts/sweep_speedup.py SWEEP [SWEEP ...] --base pre --lr 3e-3 \\
        --cand pre-gatednorm:26.8:17.7:36.7 [--cand NAME:TAX%:LO%:HI% ...]

Each candidate is NAME, or NAME:TAX:LO:HI with its norm tax and interval in percent (`benchmarks/norm_tax.py`);
without one the speedup is in tokens alone. The cells are read at --lr for both sides, from every SWEEP's runs.
"""

import argparse
from pathlib import Path
from types import SimpleNamespace

from normlab.recommend import speedup


def _cand(text: str) -> tuple[str, dict | None]:
    name, *tax = text.split(":")
    if not tax:
        return name, None
    value, lo, hi = (float(t) / 100 for t in tax)
    return name, {"value": value, "interval": [lo, hi]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", type=Path, nargs="+")
    p.add_argument("--base", required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--cand", action="append", required=True)
    args = p.parse_args()
    runs = speedup.gathered(args.sweeps)
    if runs is None:
        raise SystemExit(f"no sweep store in {', '.join(map(str, args.sweeps))}")
    base = SimpleNamespace(layout=args.base, best_lr=args.lr)
    for text in args.cand:
        name, tax = _cand(text)
        cand = SimpleNamespace(layout=name, best_lr=args.lr)
        s = speedup.for_pair(runs, args.sweeps[0], base, cand, tax, 0, 0)
        shown = speedup.words(s) if s.get("value") is not None else s.get("why")
        print(f"{name} vs {args.base} at lr {args.lr:g}: {shown}")


if __name__ == "__main__":
    main()
