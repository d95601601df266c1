"""The docs say what the code does: quoted outputs re-run (the cheap ones), counts match the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from normlab.experiments import RECIPES
from normlab.layout import PRESETS
from tests.helpers import PATIENCE_S

ROOT = Path(__file__).resolve().parents[2]


def test_cheap_quoted_outputs_have_not_drifted():
    """`scripts/quotes.py --check --cheap` re-runs every quoted `normlab show`/`layouts`/`recipes` block."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "quotes.py"), "--check", "--cheap"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]


def test_the_quote_checker_catches_drift(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("quotes", ROOT / "scripts" / "quotes.py")
    quotes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quotes)
    doc = tmp_path / "README.md"
    doc.write_text(
        "<!-- quote: normlab show pre --size nano -->\n```\n$ normlab show pre --size nano\nstale\n```\n"
        "<!-- /quote -->\n"
    )
    monkeypatch.setattr(quotes, "docs", lambda: [doc])
    monkeypatch.setattr(quotes, "ROOT", tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    assert quotes.main(["--check"]) == 1
    assert quotes.main([]) == 0 and "layout pre:" in doc.read_text()  # rewritten from a fresh run
    assert quotes.main(["--check"]) == 0
    assert quotes._comparable("loss 1.0   (6.1s)") == quotes._comparable("loss 1.0   (23.4s)")


def test_counts_in_the_readme_match_the_registries():
    readme = (ROOT / "README.md").read_text()
    assert f"({len(PRESETS)} presets)" in readme
    cpu = [n for n in RECIPES if not n.startswith("gpu-")]
    words = dict(
        enumerate(
            [
                "zero",
                "one",
                "two",
                "three",
                "four",
                "five",
                "six",
                "seven",
                "eight",
                "nine",
                "ten",
                "eleven",
                "twelve",
                "thirteen",
                "fourteen",
                "fifteen",
                "sixteen",
                "seventeen",
                "eighteen",
                "nineteen",
                "twenty",
            ]
        )
    )
    words.update({20 + i: f"twenty-{words[i]}" for i in range(1, 10)})
    for tens, word in ((30, "thirty"), (40, "forty"), (50, "fifty"), (60, "sixty"), (70, "seventy"), (80, "eighty")):
        words.update({tens: word, **{tens + i: f"{word}-{words[i]}" for i in range(1, 10)}})
    assert f"{words[len(cpu)].capitalize()} recipes restate" in readme
    assert f"{words[len(RECIPES) - len(cpu)]} `gpu-*` recipes" in readme
