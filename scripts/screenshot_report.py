"""Render a normlab page (a run report, a sweep report, a recommendation) in headless Chromium: a PNG
at a given window width, and the layout facts a test can check (does every table fit the window?).

    python scripts/screenshot_report.py runs/compare/report/index.html            # -> index.png, 1400 px wide
    python scripts/screenshot_report.py PAGE --width 1400 --png shot.png --check  # exit 1 if a table is cut

The layout check runs in the browser: a copy of the page with a small script appended that writes,
for every table, its right edge and its scroll width against the window's, into the page; Chromium's
``--dump-dom`` prints the page after the script ran. Needs a Chromium binary (Debian: ``apt-get install
chromium``); nothing else. Written by hand: Chromium's command line renders and dumps, and this file
only gives it the page.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--force-device-scale-factor=1",
)

# every table's box against the window: a table (or its scroll container) wider than the window is cut off
MEASURE = """<script>
(function () {
  var out = {viewport: window.innerWidth, page: document.documentElement.scrollWidth, tables: []};
  document.querySelectorAll('table').forEach(function (t, i) {
    var r = t.getBoundingClientRect(), box = t.parentElement.getBoundingClientRect();
    out.tables.push({index: i, left: r.left, right: r.right, width: r.width, scroll_width: t.scrollWidth,
                     container_right: box.right, columns: t.rows.length ? t.rows[0].cells.length : 0,
                     head: Array.from(t.rows.length ? t.rows[0].cells : [])
                       .map(function (c) { return c.textContent; })});
  });
  var pre = document.createElement('pre');
  pre.id = 'normlab-layout';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def find_browser() -> str | None:
    """The first Chromium-family binary on PATH, or None."""
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _run(browser: str, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state from another run
        return subprocess.run(
            [browser, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
        )


def screenshot(page: Path, png: Path, width: int = 1400, height: int | None = None, browser: str | None = None) -> Path:
    """``page`` rendered into ``png`` at ``width`` px; ``height``: the window's (default: the whole page)."""
    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium on PATH (Debian: apt-get install chromium)")
    if height is None:
        height = max(900, int(measure(page, width, browser)["height"]) + 40)
    res = _run(browser, [f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri()])
    if res.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium could not render {page}: {res.stderr[-2000:]}")
    return png


def measure(page: Path, width: int = 1400, browser: str | None = None) -> dict:
    """The page's layout at ``width`` px, measured in the browser: viewport, page scroll width and height,
    and per table its left/right edge, width, scroll width and header cells."""
    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium on PATH (Debian: apt-get install chromium)")
    text = page.read_text()
    script = MEASURE.replace("var out = {", "var out = {height: document.documentElement.scrollHeight, ")
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / page.name  # beside nothing: the page is self-contained (images embedded)
        probe.write_text(text.replace("</body>", script + "</body>") if "</body>" in text else text + script)
        res = _run(browser, [f"--window-size={width},900", "--dump-dom", probe.as_uri()])
    found = re.search(r'<pre id="normlab-layout">(.*?)</pre>', res.stdout, re.S)
    if res.returncode != 0 or not found:
        raise RuntimeError(f"chromium did not run the layout check on {page}: {res.stderr[-2000:]}")
    import html

    return json.loads(html.unescape(found.group(1)))


def cut_tables(facts: dict) -> list[str]:
    """The tables that do not fit the window (their right edge or their content past it), in words."""
    bad = []
    for t in facts["tables"]:
        if t["right"] > facts["viewport"] + 0.5 or t["scroll_width"] > t["width"] + 0.5:
            bad.append(
                f"table {t['index']} ({', '.join(t['head'][:3])}, ...): right edge {t['right']:.0f} px, "
                f"content {t['scroll_width']} px, window {facts['viewport']} px"
            )
    if facts["page"] > facts["viewport"]:
        bad.append(f"the page scrolls sideways: {facts['page']} px in a {facts['viewport']} px window")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("page", type=Path, help="an HTML page normlab wrote (report/index.html, report.html)")
    p.add_argument("--width", type=int, default=1400, help="window width in px (default 1400)")
    p.add_argument("--png", type=Path, help="where the screenshot goes (default: the page's name with .png)")
    p.add_argument("--check", action="store_true", help="exit 1 if a table is wider than the window")
    args = p.parse_args(argv)
    if find_browser() is None:
        print("no Chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    png = screenshot(args.page, args.png or args.page.with_suffix(".png"), args.width)
    facts = measure(args.page, args.width)
    print(f"{png} ({args.width} px wide, {len(facts['tables'])} tables)")
    cut = cut_tables(facts)
    for line in cut:
        print(f"cut off: {line}")
    return 1 if cut and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
