"""Trace the walk of one function through normlab's modules while a command runs, and count its rooms, stays and
returns.

    python scripts/trace_walk.py --root normlab.experiments.cluster:Coordinator.run -- \
        -m normlab sweep my-sweep.toml --out runs/sweeps/traced

(`--root` may be given more than once: each root's walk is counted on the same run; without `--distinct` both the
walk of every call and that of distinct call sites are printed.)

Definitions (the ones issue 65 judges the SLURM executor's and recommend's conclusion's walks by):

- **The frames traced** are every frame of the root function (`MODULE:QUALNAME`, e.g.
  `normlab.experiments.cluster:Coordinator.run`) and, below it, every frame of a normlab function it calls,
  directly or through other normlab functions (`--scope tree`, the default); with `--scope module`, only the frames
  of the root's own module below it (the root's module calling out, not what the callees call); with
  `--scope direct`, the root's own frames only. A call into code outside normlab (the standard library, submitit,
  torch) is not followed. A comprehension or generator expression runs in a frame of its own on Python 3.11 and is
  counted as a call into the module it is written in; with `--comprehensions inline` it is part of the function it
  is written in (as 3.12 inlines comprehensions, PEP 709): its calls are that function's, entering it no move.
- **The walk** is the sequence of normlab modules (rooms) entered by the calls made from the traced frames while the
  command runs, in the order they are made, starting with the root's own module. With `--distinct`, each call site
  (the caller's code and line, the callee's code) counts once, the first time it runs: the walk of one pass through
  the code, whatever the number of polls.
- **Rooms**: the distinct modules of the walk. **A stay**: a call into the module the walk is already in (the
  previous entry). **A return**: a call into a module the walk was in before and has left since (not the previous
  entry, but an earlier one). A call into a module not seen before is neither.

Prints the counts, the rooms in the order first entered, and the moves that return most often (from -> to);
`--json PATH` writes them with the whole walk. The command runs as `python -m MODULE ARGS` (`-m`) or as
`python SCRIPT ARGS`, in this process, under `sys.setprofile`; its exit status is kept.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

PACKAGE = "normlab"
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # frames of a comprehension, not calls in the code


@dataclass
class Walk:
    """The rooms entered, call by call, and the counts over them."""

    rooms: list[str] = field(default_factory=list)  # the walk: one module per call, the root's module first
    callees: list[str] = field(default_factory=list)  # the function each call entered (QUALNAME), beside `rooms`

    def counts(self) -> dict[str, Any]:
        seen: set[str] = set()
        stays = returns = 0
        moves: Counter[str] = Counter()
        for i, room in enumerate(self.rooms):
            if i and room == self.rooms[i - 1]:
                stays += 1
            elif room in seen:
                returns += 1
                moves[f"{self.rooms[i - 1]} -> {room}"] += 1
            seen.add(room)
        return {
            "calls": max(0, len(self.rooms) - 1),
            "rooms": len(seen),
            "stays": stays,
            "returns": returns,
            "order": list(dict.fromkeys(self.rooms)),
            "returning_moves": dict(moves.most_common()),
        }


class Tracer:
    """A `sys.setprofile` function recording the walk of the root's frames (module docstring)."""

    def __init__(self, root: str, scope: str = "tree", distinct: bool = False, inline: bool = False) -> None:
        self.module, _, self.qualname = root.partition(":")
        if not self.qualname:
            raise SystemExit(f"--root {root!r}: give MODULE:QUALNAME, e.g. normlab.experiments.cluster:Coordinator.run")
        self.scope, self.distinct, self.inline = scope, distinct, inline
        self.traced: set[int] = set()  # ids of the live frames whose calls are recorded
        self.sites: set[tuple[Any, int, Any]] = set()
        self.walk = Walk()
        self.entered = 0  # how many times the root was called

    def is_root(self, frame: FrameType) -> bool:
        code = frame.f_code
        return code.co_qualname == self.qualname and frame.f_globals.get("__name__") == self.module

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "return":
            self.traced.discard(id(frame))
            return
        if event != "call":
            return
        if self.is_root(frame):
            self.traced.add(id(frame))
            self.entered += 1
            if not self.walk.rooms:
                self.walk.rooms.append(self.module)
                self.walk.callees.append(self.qualname)
            return
        caller = frame.f_back
        if caller is None or id(caller) not in self.traced:
            return
        module = str(frame.f_globals.get("__name__", ""))
        if module != PACKAGE and not module.startswith(PACKAGE + "."):
            return
        if (
            self.inline and frame.f_code.co_name in INLINE
        ):  # part of its caller: traced as the caller is, not a move of the walk
            self.traced.add(id(frame))
            return
        if self.scope == "tree" or (self.scope == "module" and module == self.module):
            self.traced.add(id(frame))
        if self.distinct:
            site = (caller.f_code, caller.f_lineno, frame.f_code)
            if site in self.sites:
                return
            self.sites.add(site)
        self.walk.rooms.append(module)
        self.walk.callees.append(frame.f_code.co_qualname)


def run_traced(tracer: Callable[[FrameType, str, object], None], command: list[str]) -> int:
    """Run `command` (`-m MODULE ARGS` or `SCRIPT ARGS`) here under the profiler; its exit status."""
    if not command:
        raise SystemExit("give the command to trace after --, e.g. -- -m normlab sweep my-sweep.toml")
    as_module = command[0] == "-m"
    target = command[1] if as_module else command[0]
    sys.argv = [target, *command[2 if as_module else 1 :]]
    status = 0
    sys.setprofile(tracer)
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.setprofile(None)
    return status


def report(tracer: Tracer, status: int) -> dict[str, Any]:
    found = tracer.walk.counts()
    mode = f"scope {tracer.scope}" + (", distinct call sites" if tracer.distinct else ", every call")
    mode += ", comprehensions inline" if tracer.inline else ""
    print(f"\nwalk of {tracer.module}:{tracer.qualname} ({mode}; entered {tracer.entered} time(s), exit {status})")
    print(f"  {found['rooms']} rooms, {found['stays']} stays, {found['returns']} returns over {found['calls']} calls")
    print("  rooms in order: " + ", ".join(r.removeprefix(PACKAGE + ".") for r in found["order"]))
    for move, n in list(found["returning_moves"].items())[:8]:
        print(f"  {n:5d}  {move.replace(PACKAGE + '.', '')}")
    return {
        "root": f"{tracer.module}:{tracer.qualname}",
        "scope": tracer.scope,
        "distinct": tracer.distinct,
        "inline": tracer.inline,
        **found,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", action="append", required=True, help="MODULE:QUALNAME of a function whose walk is traced (repeatable)"
    )
    parser.add_argument("--scope", choices=("tree", "module", "direct"), action="append", help="repeatable; tree")
    parser.add_argument("--distinct", action="store_true", help="each call site once (one pass through the code)")
    parser.add_argument("--comprehensions", choices=("calls", "inline", "both"), default="calls")
    parser.add_argument("--json", help="write the counts and the whole walk here")
    args = parser.parse_args(argv[:cut])
    both = (True,) if args.distinct else (False, True)
    scopes = args.scope or ["tree"]
    inline = {"calls": (False,), "inline": (True,), "both": (False, True)}[args.comprehensions]
    tracers = [
        Tracer(root, scope, distinct, flat)
        for root in args.root
        for scope in scopes
        for flat in inline
        for distinct in both
    ]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        for t in tracers:
            t(frame, event, arg)

    status = run_traced(profile, argv[cut + 1 :])
    found = [report(t, status) for t in tracers]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                [{**f, "walk": t.walk.rooms, "callees": t.walk.callees} for f, t in zip(found, tracers)], out, indent=1
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
