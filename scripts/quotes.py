"""Keep the outputs the docs quote true: re-run each quoted command and rewrite its block, or check.

A quoted output in README.md or docs/*.md sits between two markers, with the command on the first
line of the fenced block::

    <!-- quote: normlab show 'hybrid*' --size tiny -->
    ```
    $ normlab show 'hybrid*' --size tiny
    ...what it printed...
    ```
    <!-- /quote -->

    python scripts/quotes.py            # re-run every quoted command, rewrite the blocks
    python scripts/quotes.py --check    # exit 1 and name the blocks whose output drifted
    python scripts/quotes.py --check --cheap   # only commands that take seconds (the test suite's)

Wall times printed by a command ("(6.1s)") are not compared. Written by hand: no documentation tool
re-runs a CLI and diffs its output against Markdown blocks.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- quote: (?P<cmd>.+?) -->\n```[a-z]*\n)(?P<body>.*?)(```\n<!-- /quote -->)", re.S)
NOISE = [re.compile(r"\(\d+(\.\d+)?s\)"), re.compile(r"; [\d,]+ tok/s")]  # timings: "(6.1s)", "; 9,872 tok/s"
CHEAP = ("normlab show", "normlab layouts", "normlab recipes")  # seconds each; `normlab demo` takes ~30 s


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run(cmd: str) -> str:
    argv = shlex.split(cmd)
    if argv[0] == "normlab":  # this checkout's normlab, whatever is installed
        argv = [sys.executable, "-m", "normlab", *argv[1:]]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    with tempfile.TemporaryDirectory() as cwd:  # relative --out paths start empty: a run is trained, not found
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"quoted command failed ({res.returncode}): {cmd}\n{res.stderr[-2000:]}")
    return f"$ {cmd}\n{res.stdout.rstrip()}\n"


def _comparable(text: str) -> str:
    for pattern in NOISE:
        text = pattern.sub("(...)", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def blocks(path: Path) -> list[re.Match]:
    return list(BLOCK.finditer(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, do not rewrite; exit 1 on drift")
    ap.add_argument("--cheap", action="store_true", help="only the commands that take seconds")
    args = ap.parse_args(argv)
    drifted = []
    for path in docs():
        text = path.read_text()
        out, last = [], 0
        for m in BLOCK.finditer(text):
            cmd = m.group("cmd")
            out.append(text[last : m.start()])
            last = m.end()
            if args.cheap and not cmd.startswith(CHEAP):
                out.append(m.group(0))
                continue
            fresh = run(cmd)
            if _comparable(fresh) != _comparable(m.group("body")):
                drifted.append(f"{path.relative_to(ROOT)}: {cmd}")
            out.append(m.group(1) + fresh + m.group(4))
        out.append(text[last:])
        if not args.check and "".join(out) != text:
            path.write_text("".join(out))
    for d in drifted:
        print(("drifted: " if args.check else "rewritten: ") + d)
    return 1 if args.check and drifted else 0


if __name__ == "__main__":
    raise SystemExit(main())
