"""What a config key is and what it may hold: `Rule` (a value's type, bounds or choices, and the one-line error
when a value breaks it), `Entries` (the rule of every list-valued key), the string forms of the records some keys
hold, and `Key`; config/schema.py declares every key with them."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

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
    test: Callable[[Any], bool] | None = None  # a further condition on a value of the right kind
    what: str = ""  # what `test` asks, as the error says it ("a regular expression")

    def allowed(self) -> str:
        if self.what:
            return self.what
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
        ok = ok and (self.test is None or self.test(value))
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


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


FLAG, TEXT, NAME = Rule(bool), Rule(str), Rule(str, nonempty=True)
IDENTIFIER = Rule(str, test=str.isidentifier, what="a name of letters, digits and _ (not starting with a digit)")
WORD = Rule(str, test=lambda text: not any(c.isspace() for c in text), what="a string without spaces")
REGEX = Rule(str, test=_compiles, what="a regular expression (Python re)")


# The string forms of schema.py's records and entries: what a user may type on the command line (and what a saved
# config of before holds).


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def is_direction(text: str) -> bool:
    """SRC-TGT (two language suffixes without '-'), `all`, or LANG-centric; data/languages.py gives them meaning."""
    head, dash, tail = text.partition("-")
    return text == "all" or (bool(dash) and bool(head) and bool(tail) and "-" not in tail and head != tail)


DIRECTION = Rule(str, test=is_direction, what="SRC-TGT (two different languages), all, or LANG-centric")


def direction_lines_from_text(text: str) -> tuple | None:
    """A data.direction_lines record from the command line's SRC-TGT=LINES; None for another form."""
    name, equals, lines = text.partition("=")
    return (name, int(lines)) if equals and lines.isdigit() else None


language_code_from_text = direction_lines_from_text  # model.language_codes' CODE=ID, the same NAME=NUMBER form


def corpus_from_text(text: str) -> tuple | None:
    """A data.corpora record from its form of before, NAME=KIND:WHERE:WEIGHT[:TAG] (WHERE may hold ':'; a last part
    that is not a number is the TAG); None for another form."""
    name, equals, rest = text.partition("=")
    parts = rest.split(":")
    tag = parts.pop() if len(parts) > 3 and number(parts[-1]) is None else ""
    if not equals or len(parts) < 3 or number(parts[-1]) is None:
        return None
    return (name, parts[0], ":".join(parts[1:-1]), number(parts[-1]), tag)


def valid_set_from_text(text: str) -> tuple | None:
    """An eval.extra_valid record from its form of before, NAME=TEXT_DIR[:SPLIT]; None for another form."""
    name, equals, where = text.partition("=")
    return (name, *(where.rsplit(":", 1) if ":" in where else (where, "valid"))) if equals else None


def files_pair(corpus: tuple) -> str:
    ok = corpus[1] != "files" or len([path for path in corpus[2].split("+") if path]) == 2
    return "" if ok else f"files needs SRC_FILE+TGT_FILE, got {corpus[2]!r}"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a record (an entry of a list-valued key); a trailing field with a `default` may be left out."""

    name: str
    rule: Rule
    default: Any = None  # None: required


@dataclasses.dataclass(frozen=True)
class Entries:
    """The one rule of every list-valued key: a tuple of strings, each checked by `each`, or (with `fields`) of
    records, each a tuple of those fields in that order, the first its distinct name.

    `split` turns what a user may write into that tuple before it is checked: every string is split at its commas,
    so one comma-joined value works wherever a tuple does (`--config.KEY=a,b`, which ml_collections gives as
    ('a,b',), and the string an older saved config holds); a record string in the key's form of before (`form`,
    e.g. NAME=KIND:WHERE:WEIGHT) is read by `text`. An entry therefore never holds a comma.
    """

    each: Rule | None = None  # the rule of a string entry
    fields: tuple[Field, ...] = ()  # the fields of a record entry
    text: Callable[[str], tuple | None] | None = None  # a record from its string `form`; None: not that form
    together: Callable[[tuple], str] | None = None  # what a record's fields must satisfy together: the problem, or ""
    noun: str = "entry"  # what an entry is, for the error message
    unit: str = ""
    kind: ClassVar[type] = tuple
    choices: ClassVar[None] = None

    def split(self, key: str, value: Any) -> Any:
        """The value as the tuple it stands for (blanks dropped, a short record completed by its fields' defaults,
        a string entry given twice kept once). ConfigError for a record string not of `form`; anything else wrong
        is left to `check`."""
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, tuple | list):
            return value
        entries: list[Any] = []
        for entry in value:
            parts = [part.strip() for part in entry.split(",") if part.strip()] if isinstance(entry, str) else [entry]
            for part in parts:
                if self.fields:
                    entries.append(self._record(key, part))
                elif part not in entries:
                    entries.append(part)
        return tuple(entries)

    def _record(self, key: str, entry: Any) -> Any:
        if isinstance(entry, str):
            record = self.text(entry)
            if record is None:
                names = ", ".join(f.name for f in self.fields)
                raise ConfigError(f"config key {key}: {entry!r} is not {self.form} (or give the tuple ({names}))")
            entry = record
        if not isinstance(entry, tuple | list):
            return entry
        left_out = self.fields[len(entry) :]
        if any(field.default is None for field in left_out):
            return entry  # a required field is missing: `check` says so
        return tuple(entry) + tuple(field.default for field in left_out)

    @property
    def form(self) -> str:
        """A record's string form of before: NAME=KIND:WHERE:WEIGHT[:TAG] for (name, kind, where, weight, tag='')."""
        name, *required = (f.name.upper() for f in self.fields if f.default is None)
        optional = "".join(f"[:{f.name.upper()}]" for f in self.fields if f.default is not None)
        return f"{name}={':'.join(required)}{optional}"

    def allowed(self) -> str:
        if not self.fields:
            return f"a tuple of strings, each {self.each.allowed()}"
        return f"a tuple of records ({', '.join(f.name for f in self.fields)}), or one string {self.form},..."

    def check(self, key: str, value: Any, name: str | None = None) -> None:
        """ConfigError naming the key and the entry unless `value` (split already) is allowed."""
        name = name or f"config key {key}"
        if not isinstance(value, tuple | list):
            raise ConfigError(f"{name}: must be {self.allowed()}, got {value!r} ({type(value).__name__})")
        names: set[Any] = set()
        for entry in value:
            if not self.fields:
                self.each.check(key, entry, name)
                continue
            if not isinstance(entry, tuple | list) or len(entry) != len(self.fields):
                raise ConfigError(f"{name}: {self.noun} {entry!r} is not a record; must be {self.allowed()}")
            for field, item in zip(self.fields, entry, strict=True):
                field.rule.check(key, item, f"{name}: the {field.name} of {self.noun} {entry[0]!r}")
            problem = self.together(tuple(entry)) if self.together else ""
            if problem:
                raise ConfigError(f"{name}: {self.noun} {entry[0]!r}: {problem}")
            if entry[0] in names:
                raise ConfigError(f"{name}: the name {entry[0]!r} is given twice; name each {self.noun} once")
            names.add(entry[0])


MATCH, MAY_CHANGE = "must match", "may change"  # on resume: whether a restart must keep the checkpoint's value


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: dotted name, default (a value, or a function of the size's `Size` row), what it may hold,
    its unit and meaning, whether a restart must keep it (`resume`: MATCH or MAY_CHANGE) and whether a fine-tuning
    run takes it from its source (`architecture`)."""

    name: str
    default: Any
    rule: Rule | Entries
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
