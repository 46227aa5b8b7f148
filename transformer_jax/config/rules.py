"""What a config key is and what it may hold: `Rule` (a value's type, bounds or choices, and the one-line error
when a value breaks it) and `Key` (one key's name, default, rule, meaning and resume decisions). config/schema.py
declares every key with them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

from transformer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one config key may hold. `low`/`high` bound numbers (inclusive unless *_open); `choices` lists strings
    (or returns them, for a registry); `unit` says what the number counts, for the error message."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None
    nonempty: bool = False
    unit: str = ""

    def allowed(self) -> str:
        if self.choices is not None:
            return f"one of {list(self.options())}"
        if self.kind is bool:
            return "True or False"
        if self.kind is str:
            return "a non-empty string" if self.nonempty else "a string"
        noun = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right} ({noun}"
        elif self.low == 0 and self.low_open or self.low == 1 and self.kind is int:
            text = f"positive ({noun} {'> 0' if self.low_open else '>= 1'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)} ({noun}"
        else:
            text = f"{noun} ("
        return text + (f", {self.unit})" if self.unit else ")")

    def options(self) -> tuple[str, ...]:
        return tuple(self.choices()) if callable(self.choices) else tuple(self.choices or ())

    def check(self, key: str, value: Any, name: str | None = None) -> None:
        """ConfigError unless `value` is allowed; `name` is how the user set it (default: `config key KEY`)."""
        name = name or f"config key {key}"
        if self.choices is not None:
            if value not in self.options():
                raise ConfigError(f"{name}: unknown value {value!r}; choose one of {list(self.options())}")
            return
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is str:
            ok = isinstance(value, str) and (bool(value) or not self.nonempty)
        elif isinstance(value, bool) or not isinstance(value, int if self.kind is int else (int, float)):
            ok = False
        else:
            ok = (
                (self.kind is int or math.isfinite(value))
                and (self.low is None or (value > self.low if self.low_open else value >= self.low))
                and (self.high is None or (value < self.high if self.high_open else value <= self.high))
            )
        if not ok:
            wrong_type = isinstance(value, bool) is not (self.kind is bool) or not isinstance(value, (self.kind, int))
            got = f"{value!r} ({type(value).__name__})" if wrong_type else repr(value)
            raise ConfigError(f"{name}: must be {self.allowed()}, got {got}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def count(low: int = 1, high: int | None = None) -> Rule:
    return Rule(int, low=low, high=high, high_open=high is not None)


def positive() -> Rule:
    return Rule(float, low=0, low_open=True)


def at_least_zero() -> Rule:
    return Rule(float, low=0)


def fraction(low_open: bool = False, high_open: bool = True) -> Rule:
    return Rule(float, low=0, high=1, low_open=low_open, high_open=high_open)


def choice(options: tuple[str, ...] | Callable[[], Iterable[str]]) -> Rule:
    return Rule(str, choices=options)


FLAG, TEXT, NAME = Rule(bool), Rule(str), Rule(str, nonempty=True)
MATCH, MAY_CHANGE = "must match", "may change"  # on resume: whether a restart must keep the checkpoint's value


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: dotted name, default (a value, or a function of the size's `Size` row), what it may hold,
    its unit and meaning, whether a restart must keep it (`resume`: MATCH or MAY_CHANGE) and whether a fine-tuning
    run takes it from its source (`architecture`)."""

    name: str
    default: Any
    rule: Rule
    doc: str
    resume: str  # MATCH or MAY_CHANGE
    architecture: bool = False  # shapes the parameters or the computation, or what the token ids mean

    def __post_init__(self) -> None:
        if not self.doc:
            raise ValueError(f"config key {self.name}: say its unit and meaning")
        if self.resume not in (MATCH, MAY_CHANGE):
            raise ValueError(f"config key {self.name}: resume must be MATCH or MAY_CHANGE, got {self.resume!r}")
        object.__setattr__(self, "rule", dataclasses.replace(self.rule, unit=self.doc))  # errors quote the doc

    def default_for(self, size: Any) -> Any:
        return self.default(size) if callable(self.default) else self.default
