"""Adding a norm kind at run time: its facts row (normlab.layout.norm_kinds.NormKindFacts) and its torch module
(normlab.model.norms.NormModule) registered together, and taken out again.

A kind written into those two files is registered at import; `register_norm_kind` does the same for a kind
defined elsewhere (a user's, a test's). Everything that decides by kind reads the two registries
(``NORM_FACTS``, ``NORM_MODULES``); the few names computed from them at import (the layout grammar's list of
kinds, the point-wise and gained kinds, the classes that count as norms) are recomputed here on each change, so
the layout parses the new kind, the model builds it and every consumer of the facts (the screen, the probes,
recommend) reads its row.
"""

from __future__ import annotations

from normlab.layout import norm_kinds, sites, spec
from normlab.layout.norm_kinds import NORM_FACTS, NormKindFacts
from normlab.model import norms
from normlab.model.norms import NORM_MODULES, NormModule


def _recompute() -> None:
    """The names derived from the registries at import, from the registries as they are now."""
    facts = tuple(NORM_FACTS.values())
    norm_kinds.NORM_KIND_FACTS = facts
    for module in (sites, spec):  # the grammar's check (spec imports the name from sites)
        vars(module)["NORM_KINDS"] = tuple(NORM_FACTS)
    sites.ALPHA_KINDS = tuple(f.name for f in facts if f.pointwise)
    sites._GAINED = tuple(f.name for f in facts if f.gained)
    norms.NORM_TYPES = tuple(dict.fromkeys((*norms.NORM_TYPES, *(m.cls for m in NORM_MODULES.values()))))


def register_norm_kind(facts: NormKindFacts, module: NormModule) -> None:
    """Add the kind ``facts.name``: its facts and its module (a point-wise kind's module measures its own
    ``saturated_share(x)``, as DyT's does). Refused (ValueError) for a name already registered."""
    if facts.name in NORM_FACTS or facts.name in NORM_MODULES:
        raise ValueError(f"norm kind {facts.name!r} is already registered; registered: {', '.join(NORM_FACTS)}")
    if facts.pointwise and not callable(getattr(module.cls, "saturated_share", None)):
        raise ValueError(f"norm kind {facts.name!r} is point-wise: its module must measure saturated_share(x)")
    NORM_FACTS[facts.name] = facts
    NORM_MODULES[facts.name] = module
    _recompute()


def unregister_norm_kind(name: str) -> None:
    """Take the kind ``name`` out of both registries (a no-op for a name not registered)."""
    module = NORM_MODULES.pop(name, None)
    NORM_FACTS.pop(name, None)
    if module is not None and all(m.cls is not module.cls for m in NORM_MODULES.values()):
        norms.NORM_TYPES = tuple(t for t in norms.NORM_TYPES if t is not module.cls)
    _recompute()
