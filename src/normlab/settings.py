"""The settings engine: one declaration per setting, from which values are checked, flags are made
and docs are written. Every configuration of normlab is built on it: `TrainConfig` (train, sweep
bases and grids, compare, screen's model shape), `SweepConfig`, `ScreenConfig`, `CompareConfig`,
`EvalConfig`, `PrepareConfig`, `ScanConfig`.

A setting is a dataclass field made by `setting(default, doc, ...)`: its metadata holds the doc, the
valid choices, a range check, whether it is part of a run's identity, and the command-line flag's
metavar. `leaves(cls)` reads a configuration's declarations; `coerce` checks one value against its
declaration (command-line text is parsed, TOML/JSON values must already have the type); `build` makes
a configuration from a mapping of values, refusing unknown keys with the closest valid one; and
`add_flags` / `given` turn the declarations into argparse flags and back.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from normlab.errors import ConfigError

T = TypeVar("T")


# --- declarations -----------------------------------------------------------------------------------


def setting(
    default: Any,
    doc: str,
    *,
    identity: bool = True,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
    metavar: str | None = None,
) -> Any:
    """A declared setting: its default, doc, identity mark, choices, range check and flag metavar."""
    meta = {"doc": doc, "identity": identity, "choices": choices, "check": check, "metavar": metavar}
    if isinstance(default, (dict, list, tuple)) or callable(default):
        factory = default if callable(default) else (lambda d=default: d)
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def nonneg(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit(v: Any) -> str | None:
    return None if 0 <= v < 1 else "must lie in [0, 1)"


def open_unit(v: Any) -> str | None:
    return None if 0 < v < 1 else "must lie in (0, 1)"


def set_choices(cls: Any, name: str, choices: tuple[Any, ...]) -> None:
    """Re-declare the choices of setting ``name`` of ``cls``: for a registry that gained or lost a row at run time
    (normlab.train.optim_registry), so that values and flags are checked against the registry as it is now."""
    f = cls.__dataclass_fields__[name]
    f.metadata = types.MappingProxyType({**f.metadata, "choices": choices})
    _leaves.cache_clear()


@dataclass(frozen=True)
class Leaf:
    """One addressable setting: its key, section, type and metadata."""

    name: str
    section: str
    type: Any
    default: Any
    doc: str
    identity: bool
    choices: tuple[Any, ...] | None
    check: Callable[[Any], str | None] | None
    metavar: str | None = None


def leaves(cls: type, section: str = "") -> dict[str, Leaf]:
    """The declared settings of a configuration dataclass, by name."""
    return dict(_leaves(cls, section))


@functools.cache
def _leaves(cls: type, section: str) -> dict[str, Leaf]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if "doc" not in f.metadata:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = Leaf(
            f.name,
            section,
            hints[f.name],
            default,
            f.metadata["doc"],
            f.metadata["identity"],
            f.metadata["choices"],
            f.metadata["check"],
            f.metadata.get("metavar"),
        )
    return out


# --- values -----------------------------------------------------------------------------------------


def _scalar_type(t: Any) -> tuple[Any, bool, tuple[Any, ...] | None]:
    """(base type, nullable, literal choices) of an annotation."""
    nullable, choices = False, None
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        nullable = type(None) in args
        t = next(a for a in args if a is not type(None))
    if typing.get_origin(t) is Literal:
        choices = typing.get_args(t)
        t = type(choices[0])
    return t, nullable, choices


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def coerce(
    key: str,
    value: Any,
    annotation: Any,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
    from_text: bool = False,
) -> Any:
    """`value` as the annotated type. With `from_text` (a command line) strings are parsed; otherwise
    values must have the type already (TOML's `steps = true` or `compile = "no"` is refused, not
    read as 1 or False). NaN and inf are refused. A ``tuple[X, ...]`` takes a list (or, from text,
    values separated by commas, or by semicolons when a value holds commas), each checked as an X;
    `check` then sees the whole tuple."""
    if typing.get_origin(annotation) is tuple:
        inner = typing.get_args(annotation)[0]
        if from_text and isinstance(value, str):  # ";" separates values that hold commas (layout strings)
            value = [v.strip() for v in value.split(";" if ";" in value else ",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of values, got {value!r} ({type(value).__name__})")
        items = tuple(coerce(key, v, inner, choices, None, from_text) for v in value)
        problem = check(items) if check is not None else None
        if problem:
            raise ConfigError(f"{key} {problem}, got {', '.join(map(str, items)) or 'nothing'}")
        return items
    base, nullable, literal = _scalar_type(annotation)
    choices = choices or literal
    if from_text and isinstance(value, str) and (base is not str or (nullable and value.lower() in ("none", "null"))):
        text = value.strip()
        if nullable and text.lower() in ("none", "null"):
            return None
        if base is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"{key}: expected true or false, got {value!r}")
            value = text.lower() in _TRUE
        elif base is int:
            try:
                value = int(text, 0) if text.lower().startswith(("0x", "0b", "0o")) else int(text)
            except ValueError:
                whole = _integral(text)  # "2e11": an integer written in e-notation
                if whole is None:
                    raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
                value = whole
        elif base is float:
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if value is None:
        if not nullable:
            raise ConfigError(f"{key}: a value is required (none is not valid here)")
        return None
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r} ({type(value).__name__})")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        value = float(value)
    if base is str and not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r} ({type(value).__name__})")
    if choices and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not valid; valid: {', '.join(map(str, choices))}")
    if check is not None:
        problem = check(value)
        if problem:
            raise ConfigError(f"{key} {problem}, got {value!r}" if "got" not in problem else f"{key} {problem}")
    return value


def _integral(text: str) -> int | None:
    """The integer a number in decimal or e-notation names exactly ("2e11", "1.5e3"), None where it names
    none (a fraction, not a number, not finite, past 1e100)."""
    import decimal

    try:
        number = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return None
    if not number.is_finite() or number.adjusted() > 100 or number != number.to_integral_value():
        return None  # past 1e100: no count normlab takes, and int() of 1e999999999 would fill the memory
    return int(number)


def check_leaf(leaf: Leaf, value: Any, key: str | None = None, from_text: bool = False) -> Any:
    """One value checked (and, from text, parsed) against its declaration."""
    return coerce(key or leaf.name, value, leaf.type, leaf.choices, leaf.check, from_text)


def check_fields(obj: Any) -> None:
    """Check every declared setting of a configuration instance (made in Python, from TOML or from flags)
    and store each value in its checked type (an int given for a float becomes a float)."""
    for name, leaf in leaves(type(obj)).items():
        object.__setattr__(obj, name, check_leaf(leaf, getattr(obj, name)))


def unknown_key(key: str, valid: list[str], where: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown key {key!r}{' in ' + where if where else ''}{hint}; valid: {', '.join(valid)}")


def build(
    cls: type[T],
    values: Mapping[str, Any],
    source: str = "settings",
    from_text: bool = False,
    as_flags: bool = False,
    **fixed: Any,
) -> T:
    """A configuration of `cls` from `values` (its declared settings by name), each value checked; keys
    not declared are refused naming the closest. `fixed` passes fields that are not settings (tables,
    lists of layouts) through unchecked, for the class's own validation. `as_flags`: errors name the
    command-line flag (--seq-len) rather than the key (seq_len)."""
    decl = leaves(cls)
    checked = {}
    for key, value in values.items():
        if key not in decl:
            raise unknown_key(key, list(decl) + list(fixed), source if source != "settings" else "")
        try:
            checked[key] = check_leaf(decl[key], value, flag_name(key) if as_flags else key, from_text=from_text)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}" if source != "settings" else str(err)) from None
    return cls(**checked, **fixed)


# --- flags ------------------------------------------------------------------------------------------


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser,
    decl: Mapping[str, Leaf],
    skip: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per declared setting: ``--name-with-dashes``, its doc and default as help, its choices,
    a ``--no-`` form for booleans. Values stay text (parsed by `coerce` with the setting's type), and a
    flag not given is absent from the namespace (`given` returns only what the user said)."""
    for name, leaf in decl.items():
        if name in skip:
            continue
        default = (defaults or {}).get(name, leaf.default)
        shown = default.name if hasattr(default, "name") and not isinstance(default, str) else default
        if isinstance(shown, tuple):
            shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in shown)
        valid = f"; one of {', '.join(map(str, leaf.choices))}" if leaf.choices and len(leaf.choices) <= 24 else ""
        help_text = f"{leaf.doc} (default: {shown}{valid})".replace("%", "%%")
        if _scalar_type(leaf.type)[0] is bool:  # --name / --no-name (an optional one stays unset if neither)
            parser.add_argument(
                flag_name(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(name),
                dest=name,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=leaf.metavar or name.upper(),
                choices=leaf.choices,
            )


def given(args: argparse.Namespace, decl: Collection[str]) -> dict[str, Any]:
    """The settings named in ``decl`` (declarations or names) that the command line gave (as text)."""
    return {k: v for k, v in vars(args).items() if k in decl}


# --- the command line ---------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with normlab's rule for bad input: one line and exit status 2 (not the whole usage); an unknown
    flag is named by the command it was given to, with the closest of that command's own flags."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._commands().get(getattr(ns, "command", None) or "", self)
            command.error("unrecognized arguments: " + " ".join(extras) + _did_you_mean(command, extras))
        return ns

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(subs[0].choices) if subs else {}


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The closest of ``parser``'s own flags to each unknown one (difflib over the flags and over the words of
    their help: --learning-rate is close to lr's "peak learning rate")."""
    import difflib

    names: dict[str, str] = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                names.setdefault(flag, flag)
                words = (action.help or "").split(";")[0].split("(")[0].split(",")[0].split(":")[0].split()
                if 0 < len(words) <= 4:
                    names.setdefault("--" + "-".join(w.lower() for w in words), flag)
    bare = {name[2:]: flag for name, flag in names.items()}  # compared without the "--" every flag shares
    said = []
    for extra in extras:
        flag = extra.split("=")[0]
        close = difflib.get_close_matches(flag[2:], list(bare), n=1, cutoff=0.6) if flag.startswith("--") else []
        if close:
            said.append((flag, bare[close[0]]))
    if len(said) == 1:
        return f" (did you mean {said[0][1]}?)"
    return f" (did you mean {', '.join(f'{b} for {a}' for a, b in said)}?)" if said else ""
