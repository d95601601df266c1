"""Self-contained HTML pages: the kit behind run reports, sweep reports and scans.

A page is one HTML file with inline CSS and its figures embedded as base64 PNGs (each PNG is also
kept beside it), so it can be mailed or attached to a paper's supplement as one file. matplotlib
runs headless (Agg) with one style for every figure normlab draws.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from normlab.io import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["figure_html", "fmt", "legend", "panels", "plt", "table_html", "write_page"]  # plt: pyplot on Agg

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3})


def legend(ax: Axes, **kw: Any) -> None:
    """A legend where the axes have labelled artists (a run without probes draws none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def panels(n: int, width: float = 4.2, height: float = 3.2, share: bool = False) -> tuple[Figure, list[Axes]]:
    """One panel per run; ``share``: the same x and y axes on every panel, so layouts compare at a glance."""
    cols = min(n, 4 if n == 4 else 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, sharex=share, sharey=share
    )
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def fmt(v: object) -> str:
    """A table cell: 4 significant digits, "-" for a missing or NaN value."""
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def figure_html(fig, out: Path, key: str, title: str) -> str:  # noqa: ANN001 - a matplotlib Figure
    """Save ``fig`` as ``out/key.png`` and return an HTML section embedding it (base64). Its maker has laid it
    out (`Figure.tight_layout`, which fits titles, a suptitle and legends placed outside the axes): saved as
    laid out, since ``bbox_inches="tight"`` would measure every text again (a tenth of a report's drawing)."""
    png = out / f"{key}.png"
    fig.savefig(png)
    plt.close(fig)
    data = base64.b64encode(png.read_bytes()).decode()
    return (
        f'<h2 id="{key}">{html.escape(title)}</h2>\n<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'
    )


def _numeric(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _breakable(text: str) -> str:
    """Escaped text that may wrap after a comma, slash or equals sign (layout strings, paths have no spaces)."""
    return "".join(html.escape(c) + ("<wbr>" if c in ",/=" else "") for c in text)


def table_html(rows: list[dict]) -> str:
    """A table that fits its page: numbers right-aligned, text left-aligned and wrapped (long names and
    layout strings break rather than widen the table), in a container that scrolls sideways as a last resort."""
    if not rows:
        return "<p>(no rows)</p>"
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{html.escape(fmt(v))}</td>' if _numeric(v) else f'<td class="t">{_breakable(fmt(v))}</td>'
            for v in r.values()
        )
        + "</tr>"
        for r in rows
    )
    return f'<div class="table"><table><tr>{head}</tr>{body}</table></div>'


_PAGE_CSS = (
    "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}\n"
    "div.table{max-width:100%;overflow-x:auto}table{border-collapse:collapse;max-width:100%}\n"
    "td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top;overflow-wrap:break-word}"
    "th{background:#f3f3f3;text-align:left}\n"
    "td.n{text-align:right;white-space:nowrap}td.t{text-align:left}p.note{font-size:85%;color:#555}img{max-width:100%}"
)


def write_page(path: Path, title: str, body: str) -> Path:
    """One self-contained HTML file (inline CSS, images embedded), written atomically."""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_PAGE_CSS}</style></head>
<body>
{body}
</body></html>
"""
    atomic_write_bytes(path, page.encode())
    return path
