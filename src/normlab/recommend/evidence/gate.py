"""The gate: whether the evidence asks the user to change placement (recommendation.json's `verdict`).

marin promotes an architecture change only on effective speedup (marin-community/marin, issue 4993: a
sandwich norm at 0.83x failed). normlab's gate, for the best candidate that is not the user's placement
(the "leader") against the user's placement (the baseline):

    change          the leader trained and either
                      - speedup: the effective speedup's lower bound (`speedup`, its interval's low end,
                        after the norm tax, at the ladder's widest rung where one ran) exceeds 1 and the
                        leader is not behind the baseline on the ranking's first criteria (fewer or as many
                        failures, and among equal failures no more runs at risk, at the proxy; no more
                        failures on the ladder's rungs), or
                      - stability: every run of the baseline finished and failed (diverged or stalled) at
                        every learning rate tried while the leader trained (no finite number of the
                        baseline's tokens reaches the leader's loss)
    keep            both trained and neither condition holds, or the leader failed every run it finished:
                    the reason (no interval, the lower bound at or below 1, more failures or runs at risk)
    no answer yet   a side with no finished run (the budget stopped it: a stopped run is never a failure),
                    a failed baseline whose other runs the budget stopped, or neither trained; with what the
                    same command would add
    recommend       the user's model names no placement: no baseline to gate against; the ranking's first

The gate reads the rung it has: the proxy (the ladder's largest rung where one ran).
"""

from __future__ import annotations

from typing import Any

from normlab.recommend.evidence.rank import Evidence

RESUME = (
    "run the same command again: it resumes this folder and trains what the budget stopped (or give a larger --budget)"
)


def leader(ranked: list[Evidence], current: str | None) -> Evidence | None:
    """The best-ranked candidate other than the user's placement (ranked or not: one the budget stopped
    before it finished is still the one the question is about)."""
    others = [r for r in ranked if r.layout != current and r.status != "ruled out"]
    live = [r for r in others if r.rank is not None]
    return live[0] if live else (others[0] if others else None)


def _ok(r: Evidence | None) -> int:
    return 0 if r is None else r.finished - r.diverged - r.stalled


def _said(r: Evidence) -> str:
    """A candidate as the output names it: its change's name (yours+out) and label, else its layout."""
    return r.shown + (f" ({r.label})" if r.label else "")


def verdict(ranked: list[Evidence], current: str | None, speedup: dict[str, Any] | None) -> dict[str, Any]:
    """The gate's decision (module doc)."""
    live = [r for r in ranked if r.rank is not None]
    base = next((r for r in ranked if r.layout == current), None) if current else None
    if base is None:
        if not live:
            return {"decision": "no answer yet", "layout": None, "why": "no candidate trained", "next": RESUME}
        why = "your model names no placement: the ranking's first, with no baseline to gate against"
        return {"decision": "recommend", "layout": live[0].layout, "gate": None, "why": why}
    lead = leader(ranked, current)
    if lead is None:
        return {"decision": "keep", "layout": base.layout, "gate": None, "why": "no other candidate was left to try"}
    b_ok, l_ok = _ok(base), _ok(lead)
    b_said = (
        f"your {base.layout} finished {base.finished} of {base.runs} run(s) ({base.diverged} diverged, "
        f"{base.stalled} stalled, {base.unfinished} stopped by the budget)"
    )
    l_said = f"{_said(lead)} finished {lead.finished} of {lead.runs} ({lead.unfinished} stopped by the budget)"
    if base.finished == 0 or lead.finished == 0:  # a side the budget stopped is no evidence either way
        return {"decision": "no answer yet", "layout": None, "why": f"{b_said}; {l_said}", "next": RESUME}
    if b_ok == 0:
        if base.unfinished:  # its stopped runs may yet train: its failures so far are not a verdict
            why = f"{b_said}; {l_said}: your placement's runs did not all finish"
            return {"decision": "no answer yet", "layout": None, "why": why, "next": RESUME}
        if l_ok == 0:
            why = f"{b_said}; {l_said}: neither trained at any learning rate tried (lower the --lrs)"
            return {"decision": "no answer yet", "layout": None, "why": why, "next": RESUME}
        return {
            "decision": "change",
            "layout": lead.layout,
            "name": _said(lead),
            "gate": "stability",
            "why": f"your {base.layout} finished no run at any learning rate tried ({base.diverged} diverged, "
            f"{base.stalled} stalled of {base.finished}); {_said(lead)} finished {l_ok}",
        }
    if l_ok == 0:
        return {
            "decision": "keep",
            "layout": base.layout,
            "gate": None,
            "why": f"{_said(lead)} finished no run that trained ({lead.diverged} diverged, {lead.stalled} stalled "
            f"of {lead.finished})",
        }
    return _by_speedup(base, lead, speedup or {})


def _by_speedup(base: Evidence, lead: Evidence, s: dict[str, Any]) -> dict[str, Any]:
    """Both sides trained: the leader replaces yours only where its effective speedup's lower bound exceeds 1 and it
    fails and is at risk no more often (the ladder's rungs included)."""
    on_ladder = s.get("ladder_failures") or {}
    # the ranking's order (normlab.recommend.evidence.rank): failures first, then runs at risk among equal failures
    worse = (
        lead.failures > base.failures
        or (lead.failures == base.failures and lead.risk_share > base.risk_share)
        or on_ladder.get(lead.layout, 0) > on_ladder.get(base.layout, 0)
    )
    iv = s.get("interval")
    if s.get("value") is None:
        why = f"no effective speedup measured ({s.get('why', 'no finished runs at the best learning rates')})"
        return {"decision": "keep", "layout": base.layout, "gate": None, "why": why, "next": RESUME}
    if iv is None:
        return {
            "decision": "keep",
            "layout": base.layout,
            "gate": None,
            "why": f"x{s['value']:.2f} measured on one seed a side: no interval, so no lower bound to pass the gate",
            "next": "a second seed of both: " + RESUME,
        }
    if iv[0] > 1 and not worse:
        return {
            "decision": "change",
            "layout": lead.layout,
            "name": _said(lead),
            "gate": "speedup",
            "why": f"effective speedup x{s['value']:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]: its lower bound exceeds 1, "
            "and it fails and is at risk no more often than yours",
        }
    if worse:
        why = (
            f"{_said(lead)} fails or is at risk more often than yours ({lead.diverged + lead.stalled} failed, "
            f"{lead.at_risk} at risk of {lead.finished}; yours {base.diverged + base.stalled} and {base.at_risk} of "
            f"{base.finished}"
            + (
                f"; on the ladder's rungs {on_ladder.get(lead.layout, 0)} failed against yours "
                f"{on_ladder.get(base.layout, 0)}"
                if on_ladder
                else ""
            )
            + ")"
        )
    else:
        why = f"effective speedup x{s['value']:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]: its lower bound does not exceed 1"
    return {"decision": "keep", "layout": base.layout, "gate": None, "why": why}


def headline(v: dict[str, Any], speedup_words: str, confidence: str | None) -> str:
    """The answer's first line: the verdict, its size, how sure."""
    sure = f" ({confidence})" if confidence else ""
    d = v["decision"]
    if d == "change":
        return f"**Change to {v.get('name') or v['layout']}**{sure}: {speedup_words or v['why']}."
    if d == "keep":
        return f"**Keep your {v['layout']}**{sure}: {v['why']}."
    if d == "recommend":
        return f"**{v['layout']}**{sure}: {v['why']}."
    return f"**No answer yet**: {v['why']}; {v.get('next', RESUME)}."
