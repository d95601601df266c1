"""What a recommendation is asked, checked before anything runs, and the proxies' run settings: the
candidates (the user's current placement first; the same placement twice, or one the model cannot take,
refused), the inputs plan.json keeps (a resumed call with other inputs is refused), every proxy run's
settings and data checked as one line, and the proxies' sweeps (`proxy_settings`, `proxy_sweep`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from normlab.config.commands import RECOMMEND_BASE, RECOMMEND_CANDIDATES, RecommendConfig
from normlab.errors import ConfigError
from normlab.experiments.sweep import SweepConfig
from normlab.layout import Layout, as_layout
from normlab.model.config import SIZES, ModelConfig
from normlab.recommend.planning import derived
from normlab.recommend.planning.shape import PROXY_WIDTH, UserModel, proxy_shape
from normlab.train.trainer import load_run_data


@dataclass(frozen=True)
class Candidate:
    """One candidate placement, parsed once: its name as given (a preset, a string form, or a change made from the
    user's placement, `yours+out`), its label where it is such a change ("your model (qwen3) + output norms",
    `normlab.recommend.planning.derived`; "" otherwise) and its layout."""

    name: str
    layout: Layout
    label: str = ""

    @classmethod
    def of(cls, name: str, label: str = "") -> Candidate:
        """The candidate called ``name`` (a typo fails here, with the valid names)."""
        return cls(name, as_layout(name), label)

    @property
    def form(self) -> str:
        """Its placement's string form: two names of one placement have the same."""
        return self.layout.to_string()


def has_streams(layouts: Iterable[str | Layout | Candidate]) -> bool:
    """Whether one of the layouts has several residual streams (the plan then needs the stream rates)."""
    return any(_layout(n).streams > 1 for n in layouts)


def _layout(c: str | Layout | Candidate) -> Layout:
    return c.layout if isinstance(c, Candidate) else as_layout(c)


def unbuildable(layout: str | Layout | Candidate, user: UserModel) -> str | None:
    """Why ``layout`` cannot be built for the user's model (e.g. nGPT on grouped key/value heads), or None: what the
    model refuses (`ModelConfig.layout_problem`), at the proxies' shape and the user's depth (the screen's)."""
    shape = ModelConfig(**proxy_shape(user.config, user.config.n_layers))
    return shape.layout_problem(_layout(layout).resolve(shape.n_layers))


@dataclass(frozen=True)
class CandidateChoice:
    """What recommend compares: the candidates (the user's placement first, then the changes to it, then the
    rest), the user's placement's name, the defaults left out (name -> why), each candidate made from the
    user's placement -> its label ("your model (qwen3) + output norms", `normlab.recommend.planning.derived`), and
    which of those take away something the user has (tried last: the plan's cheap order keeps them there)."""

    names: list[str]
    current: str | None
    unfit: dict[str, str]
    labels: dict[str, str]
    removals: tuple[str, ...] = ()
    inapplicable: tuple[str, ...] = ()  # changes given (yours+out, ...) that do not apply to the user's placement
    short: dict[str, str] = field(default_factory=dict)  # a change's string form -> its name (`yours+emb`)
    candidates: tuple[Candidate, ...] = ()  # ``names``, each parsed once, with its label

    def candidate(self, name: str) -> Candidate:
        """The candidate of that name (KeyError: not one of ``names``)."""
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"{name!r} is not a candidate")

    def name(self, layout: str) -> str:
        """What the output calls a candidate: its change's name where it is one written as a string form."""
        return self.short.get(layout, layout)


def choose(cfg: RecommendConfig, user: UserModel) -> CandidateChoice:
    """The candidates (`CandidateChoice`): the --candidates names (`yours...` made from the user's placement,
    `derived.resolve`), and with the default list the default changes to the user's placement too; the same
    placement given twice (by two names, or one name twice), or one given that the model cannot take, is
    refused."""
    given = tuple(cfg.candidates) != RECOMMEND_CANDIDATES
    asked = tuple(cfg.candidates)
    quick = cfg.quick and not given  # the quick question's one change: the first that applies to the placement
    if quick:
        asked = derived.quick_default(user.layout) if user.layout else ()
    names, labels = derived.resolve(asked, user.layout)
    removals: list[str] = []
    if not given and not quick:
        made = derived.defaults(user.layout)
        names = [d.name for d in made if not d.removes] + names + [d.name for d in made if d.removes]
        labels.update({d.name: d.label for d in made})
        removals = [d.name for d in made if d.removes]
    else:
        removals = [
            d.name
            for c in asked
            if c in derived.CHANGES and derived.CHANGES[c].removes and user.layout
            if (d := derived.derive(user.layout, c)) is not None
        ]
    inapplicable = tuple(k for k, v in labels.items() if not v)  # changes given that change nothing of it
    labels = {k: v for k, v in labels.items() if v}
    chosen, current, unfit = _choose_names([Candidate.of(n, labels.get(n, "")) for n in names], user, given, not given)
    names = [c.name for c in chosen]
    return CandidateChoice(
        names,
        current,
        unfit,
        labels,
        tuple(n for n in removals if n in names),
        inapplicable=inapplicable,
        short=derived.short_names(user.layout, names),
        candidates=tuple(chosen),
    )


def choose_candidates(cfg: RecommendConfig, user: UserModel) -> tuple[list[str], str | None, dict[str, str]]:
    """`choose`'s candidates, current placement and unfit defaults."""
    c = choose(cfg, user)
    return c.names, c.current, c.unfit


def _choose_names(
    given_names: list[Candidate], user: UserModel, given: bool, allow_same: bool
) -> tuple[list[Candidate], str | None, dict[str, str]]:
    """The candidates (the user's current placement first, under its own name), that placement's name, and
    the default candidates left out because the user's model cannot take them (name -> why); the same
    placement given twice (by two names, or one name twice) is refused, or with `allow_same` (the defaults
    and the changes made from the user's placement) kept once under its first name."""
    seen: dict[str, Candidate] = {}
    for c in given_names:
        form, name = c.form, c.name
        if form in seen and allow_same:
            continue
        if form in seen:
            same = (
                f"{name!r} is given twice"
                if seen[form].name == name
                else f"{seen[form].name!r} and {name!r} are the same placement ({form})"
            )
            raise ConfigError(f"--candidates: {same}; give each placement once")
        seen[form] = c
    current = None
    if user.layout is not None:
        mine = Candidate.of(user.layout)
        first = seen.get(mine.form, mine)
        current = first.name
        seen = {first.form: first, **{f: c for f, c in seen.items() if c.name != current}}
    chosen = list(seen.values())
    unfit = {c.name: why for c in chosen if (why := unbuildable(c, user))}
    if unfit and (given or current in unfit):
        name, why = next((n, w) for n, w in unfit.items() if n == current or given)
        if name == current:
            raise ConfigError(f"your current placement {name} cannot be built at the proxies' shape ({why})")
        raise ConfigError(f"--candidates: {name} cannot be built for your model ({why}); leave it out")
    return [c for c in chosen if c.name not in unfit], current, unfit


def recorded_inputs(
    user: UserModel, cfg: RecommendConfig, precision: str, base: dict[str, Any], candidates: list[str]
) -> dict[str, Any]:
    return {
        "model": user.config.to_dict(),
        "precision": precision,
        "candidates": candidates,
        "lrs": list(cfg.lrs),
        "seeds": list(cfg.seeds),
        "depth": cfg.depth,
        "optimizer": cfg.optimizer,
        "base": base,
        "proxy": RECOMMEND_BASE,
        # the ladder asked for, where not the default (a folder planned before --ladder existed resumes as auto)
        **({"ladder": cfg.ladder} if cfg.ladder != "auto" else {}),
    }


def check_run_settings(base: dict[str, Any], name: str, lr: float, seed: int, log: Callable[[str], Any]) -> None:
    """Every proxy run's settings and data, checked before anything is screened: a bad --set value, a
    data path that does not exist, a tokenizer that cannot be read fail here, as one line."""
    spec = proxy_sweep(base, [name], [lr], [seed]).expand()[0]
    cfg = spec.train_config("unused")
    if cfg.data.task != "lm":
        raise ConfigError(f"--set task={cfg.data.task}: the proxies train a language model on text (task lm)")
    data = load_run_data(cfg)  # tokens cached: the runs read them from there
    need = cfg.data.seq_len + 1
    if len(data.train) < need * 2 or len(data.val) < need:
        raise ConfigError(
            f"data {cfg.data.data} holds {len(data.train) + len(data.val):,} tokens: too few for "
            f"sequences of {cfg.data.seq_len}; give more text or --set seq_len=N"
        )
    log(f"  proxy runs' settings and data checked ({cfg.data.data}: {len(data.train):,} training tokens)")


def proxy_settings(
    user: UserModel,
    depth: int,
    precision: str,
    extra: dict[str, Any],
    optimizer: str = "adamw",
    width: int = PROXY_WIDTH,
) -> dict[str, Any]:
    """The proxy runs' settings: the stress settings, the user's block at the proxy shape (`width`: the
    verify stage's), their precision stored (emulated on a CPU), their optimizer, and their own --set on top.
    Wider than the proxy (the verify stage) they train in muP with the proxy's width as the base shape, so the
    proxy's learning rate is the one muP carries there (at its base width muP is SP: the proxies themselves
    are unchanged; issue 54 item 4); under SGD they stay in SP (muP's SGD rule is not built)."""
    ref = SIZES[RECOMMEND_BASE["size"]].to_dict()
    model = {f"model.{k}": v for k, v in proxy_shape(user.config, depth, width).items() if ref.get(k) != v}
    if width != PROXY_WIDTH and optimizer != "sgd":  # muP's SGD rule is not built (config.train refuses it)
        model.update({"model.parametrization": "mup", "model.base_d_model": PROXY_WIDTH})
    return {**RECOMMEND_BASE, **model, "activation_dtype": precision, "optimizer": optimizer, **extra}


def proxy_sweep(
    base: dict[str, Any],
    layouts: list[str],
    lrs: list[float],
    seeds: list[int],
    name: str = "recommend",
) -> SweepConfig:

    width = base.get("model.d_model", PROXY_WIDTH)
    return SweepConfig(
        name=name,
        base=base,
        grid={"layout": layouts, "lr": lrs, "seed": seeds},
        source="normlab recommend: the proxy grid" + (" (verify: wider)" if width != PROXY_WIDTH else ""),
        scale=f"proxy d {width}, {base.get('model.n_layers', 12)} layers, {base['steps']} steps, "
        f"{base['activation_dtype']} storage, {base.get('optimizer', 'adamw')}",
    )
