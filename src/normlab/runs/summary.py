"""A run's summary.json and its forensics as typed records: `RunSummary` and `Forensics`.

The trainer writes summary.json (normlab.train.run_summary) and, for a diverged run, its ``forensics``: where the
failing step's forward first broke (normlab.diagnostics.forensics, run in normlab.train.trainer). Every module that
reads them (a sweep's reconciliation and store, its summary figures, the transfer record's devices, recommend's
speedup and cost, the start of a resumed run) reads these records instead of a dict's keys.

The keys on disk are unchanged: `from_json` keeps the order the keys were written in and every key these types do
not name (``extra``: the divergence monitor's, the step hooks', ...), and `to_json` writes exactly those keys in
that order, so a summary read and written again is the same file, an older one without a newer key stays without
it, and a value of the wrong JSON type is kept as written (in ``extra``) while its typed field reads None.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from normlab.runs.outcome import FINISHED, TRAINED

_BOOK = ("keys", "extra")  # the bookkeeping fields: not keys on disk


def _options(hint: Any) -> tuple[Any, ...]:
    """The types an annotation admits: each member of a union (``int | None``: int, NoneType), generics bare."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return tuple(typing.get_origin(t) or t for t in options)


def _read(hint: Any, value: Any) -> tuple[bool, Any]:
    """(whether a JSON value fits a field's annotation, the value as the field holds it: a nested record read)."""
    for t in _options(hint):
        if t is type(None) and value is None:
            return True, None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and (t is float or (t is int and isinstance(value, int))):  # a float field takes an int
            return True, value
        if t in (str, bool, list, dict) and isinstance(value, t):
            return True, value
        if isinstance(t, type) and issubclass(t, _Record) and isinstance(value, Mapping):
            return True, t.from_json(value)
    return False, None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A record's typed keys and their annotations (the bookkeeping fields left out), read once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k not in _BOOK}
    return _HINTS[cls]


@dataclass(frozen=True)
class _Record:
    """A JSON object read into typed fields, with the keys in their order and the keys it does not name."""

    keys: tuple[str, ...] = ()  # the keys as written, in order (none given: the typed fields that are set)
    extra: dict[str, Any] = field(default_factory=dict)  # every other key, and a typed key of the wrong type

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        hints = _hints(cls)
        typed: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            fits, held = _read(hints[key], value) if key in hints else (False, None)
            if fits:
                typed[key] = held
            else:
                extra[key] = value
        return cls(keys=tuple(data), extra=extra, **typed)

    def to_json(self) -> dict[str, Any]:
        """The object as written: its keys in their order (a record made in code: its fields that are set)."""
        names = [f.name for f in dataclasses.fields(self) if f.name not in _BOOK]
        keys = self.keys or tuple(n for n in names if getattr(self, n) is not None) + tuple(self.extra)
        out: dict[str, Any] = {}
        for key in keys:
            if key in self.extra:
                out[key] = self.extra[key]
            else:
                value = getattr(self, key)
                out[key] = value.to_json() if isinstance(value, _Record) else value
        return out


@dataclass(frozen=True)
class Forensics(_Record):
    """Where a diverged run first broke (normlab.diagnostics.forensics: the module docstring says how).

    step: the failing step; forward: the first site whose stored tensor was not finite ({module, layer, site,
    nonfinite, of, kind: "overflow" | "nan", value, before}), None where the forward stayed finite; micro_batch:
    which of the step's micro-batches broke; dtype, limit: the activation dtype and its largest finite value;
    loss: the re-run's loss; largest: the largest finite |activation| seen ({value, module, layer, site});
    gradients: the parameters whose gradients were not finite (deepest first); rank: the rank whose forward broke;
    text: all of it in one line.
    """

    step: int | None = None
    forward: dict[str, Any] | None = None
    micro_batch: int | None = None
    dtype: str | None = None
    limit: float | None = None
    loss: float | None = None
    largest: dict[str, Any] | None = None
    gradients: list[str] | None = None
    rank: int | None = None
    text: str | None = None

    @property
    def site(self) -> str | None:
        """The short form of where the forward first broke, "block 11: MLP residual add" (None: it did not)."""
        fwd = self.forward
        if not fwd:
            return None
        return str(fwd["site"]) if fwd["layer"] is None else f"block {fwd['layer']}: {fwd['site']}"

    @property
    def overflowed(self) -> bool:
        """Whether the forward broke by passing the dtype's largest value (not a NaN)."""
        return bool(self.forward) and (self.forward or {}).get("kind") == "overflow"

    def finite_values(self) -> list[Any]:
        """The largest finite |values| it saw: what flowed into the break, and the largest anywhere (None: unknown)."""
        return [(self.forward or {}).get("before"), (self.largest or {}).get("value")]


@dataclass(frozen=True)
class RunSummary(_Record):
    """A run's summary.json (written by normlab.train.run_summary.write_summary); the keys readers use, typed.

    status: ok | stalled | diverged | failed (normlab.runs.outcome); reason: why it stopped, where it did not end
    ok; steps: the metrics rows it logged; tokens: tokens trained; final_loss: the mean of the last 10 finite
    losses; activation_dtype: the dtype its activations were stored in (fp16: overflow past 65504); device_name:
    the device it trained on (device: torch's name, "cpu", "cuda:0"; device_name: its product name); tok_per_s: its
    median throughput; flops_per_token: its model FLOPs per token (normlab.train.mfu); forensics: where a
    diverged run first broke; first_break: its short form.
    """

    status: str | None = None
    reason: str | None = None
    layout: str | None = None
    steps: int | None = None
    tokens: int | None = None
    initial_loss: float | None = None
    final_loss: float | None = None
    final_val_loss: float | None = None
    diverged_step: int | None = None
    activation_dtype: str | None = None
    device: str | None = None
    device_name: str | None = None
    tok_per_s: float | None = None
    flops_per_token: float | None = None
    max_activation: float | None = None
    forensics: Forensics | None = None
    first_break: str | None = None

    def given(self, key: str) -> bool:
        """Whether the file has ``key`` (a summary written before a key existed has not)."""
        return key in self.keys

    def finished(self, steps: int | None = None) -> bool:
        """Whether the run ended (ok, stalled or diverged) and, given ``steps``, logged that many (a finished
        summary of another length is another run's)."""
        return self.status in FINISHED and (steps is None or self.steps == steps)

    @property
    def trained(self) -> bool:
        """Finished with a finite final loss (ok or stalled)."""
        return self.status in TRAINED
