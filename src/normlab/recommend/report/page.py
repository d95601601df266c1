"""recommend's files (`write_recommendation`: report.html, recommendation.md, recommendation.json); report.html: the
verdict and reason, the evidence table and the ranking figure, the ladder's figure, how sure and how large, the
recipe checks, the winner's settings in each code base, the verify stage's verdict, the transfer record, what ran
and what the proxy can and cannot tell (the words are `normlab.recommend.report.explain`'s).
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

from normlab.io import atomic_write_bytes, atomic_write_json
from normlab.pages import table_html
from normlab.pages import write_page as page
from normlab.recommend.evidence import agreement
from normlab.recommend.evidence.rank import Evidence
from normlab.recommend.report.explain import (
    ANSWER_TITLE,
    answer_items,
    fmt_loss,
    headline,
    logit_words,
    reason,
    record_lines,
    sensitivity_words,
    verify_lines,
    yes_no,
)
from normlab.recommend.report.ranking_figure import ranking_figure
from normlab.runs.files import RecommendDir

if TYPE_CHECKING:  # the record the page is read from, by attribute
    from normlab.recommend.stages.records import Recommendation


def _evidence_rows(ranked: list[Evidence]) -> list[dict[str, Any]]:
    return [
        {
            "rank": r.rank if r.rank is not None else "-",
            "layout": r.name,
            "screen": r.screen,
            "diverged": f"{r.diverged}/{r.finished}",
            "stalled": f"{r.stalled}/{r.finished}",
            "at risk": f"{r.at_risk}/{r.finished}",
            "attention logit at best lr": logit_words(r) if math.isfinite(r.logit_last) else "-",
            "largest activation": r.max_activation,
            "best lr": r.best_lr,
            "best loss": fmt_loss(r),
            "LR sensitivity": sensitivity_words(r),
            "status": r.status if r.status == "ranked" else f"{r.status}: {r.why}",
        }
        for r in ranked
    ]


def _checks_html(checks: list[dict[str, Any]]) -> str:
    rows = [
        {
            "recipe": c["recipe"],
            "verdict there": f"{c['claim']}: {c['evidence']}",
            "its setting": c["setting"],
            "ranked here": c["ranks"],
            "ranking agrees": yes_no(c["agrees"]).strip("*"),
            "at its setting, here": c.get("at_setting", "-"),
            "holds": yes_no(c.get("agrees_at_setting")).strip("*"),
        }
        for c in checks
    ]
    if not rows:
        return ""
    return f"<h2>Against the recipes</h2><p>{html.escape(agreement.summary(checks))}</p>{table_html(rows)}"


def _settings_html(result: Recommendation) -> str:
    if not result.settings:
        return ""
    h = html.escape
    return (
        f"<h2>{h(str(result.winner))} in your code base</h2>"
        + table_html(
            [
                {
                    "code base": k,
                    "expressible": v["expressible"],
                    "settings": v["settings"].split("```")[0].strip() if v.get("code") else v["settings"],
                }
                for k, v in result.settings.items()
            ]
        )
        + "".join(
            f"<h3>{h(k)}</h3><pre><code>{h(v['code'])}</code></pre>"
            for k, v in result.settings.items()
            if v.get("code")
        )
    )


def _list_html(title: str, items: list[str]) -> str:
    return f"<h2>{title}</h2><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in items) + "</ul>"


def write_recommendation(folder: RecommendDir, result: Recommendation, ranked: list[Evidence]) -> None:
    """The recommendation's three files: report.html (`write_page`), recommendation.md (its text) and
    recommendation.json (the record), each written whole."""
    write_page(folder, result, ranked)
    atomic_write_bytes(folder.markdown_file, result.text.encode())
    atomic_write_json(folder.json_file, result.to_json())


def write_page(folder: RecommendDir, result: Recommendation, ranked: list[Evidence]) -> None:
    """report.html: the reason, the evidence table and figure, the recipe checks, the winner's settings, the
    verify stage's verdict, the transfer record, what ran and what the proxy can and cannot tell."""
    h = html.escape
    live = [r for r in ranked if r.rank is not None]
    drawn = [r for r in ranked if r.rank is not None or r.unfinished]  # beside the ranked: runs the budget stopped
    verified = verify_lines(result.verify)
    answer = answer_items(result)
    body = (
        f"<h1>normlab recommend</h1><p>{h(result.model)}; precision {h(result.precision)}</p>"
        + "".join(
            f"<p><strong>{h(x.replace('**', ''))}</strong></p>" if i == 0 and result.verdict else ""
            for i, x in enumerate(headline(result, ranked)[:1])
        )
        + f"<p>{h(reason(result, ranked)).replace('**', '')}</p><h2>Evidence</h2>{table_html(_evidence_rows(ranked))}"
        + (ranking_figure(folder, drawn, result.precision) if live else "")
        + (
            f'<h2>Effective speedup against scale</h2><img src="{folder.ladder_figure.name}" alt="the ladder">'
            if folder.ladder_figure.is_file()
            else ""
        )
        + (_list_html(ANSWER_TITLE, [x.replace("**", "") for x in answer]) if answer else "")
        + _checks_html(result.recipe_checks)
        + _settings_html(result)
        + (_list_html("Did the order hold at a larger width? (--verify)", verified) if verified else "")
        + _list_html("How often the proxies have been right", record_lines(result.transfer_record))
        + (_list_html("What ran, and how far the answer could move", result.movement) if result.movement else "")
        + _list_html("What the proxy can and cannot tell", result.limits)
        + f"<p>Every run: {h(result.files['grid'])}</p>"
    )
    page(folder.report_file, "normlab recommend", body)
