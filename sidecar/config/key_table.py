"""One configuration key: what it accepts from a TOML file and from text (an environment
variable, ``--set``), and how it says so when a value is wrong.

Two kinds, both derived generically so that settings added elsewhere need no code here:

* :class:`FieldKey`: a :class:`~sidecar.config.settings.SidecarConfig` field; its type comes
  from the field's annotation, its range or choices from :data:`sidecar.config.settings.LIMITS`;
* :class:`FlagKey`: a command-line flag of a subcommand (``[demo] port`` is ``demo --port``);
  its values go through the flag's own argparse ``type`` and ``choices``, so the file and
  the flag cannot disagree on what is valid.
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from sidecar.config.settings import FLAG_DEFAULT, Limit, short
from sidecar.config.toml_file import FileProblem, parse_toml

ENV_PREFIX = "KVSIDECAR_"
SIDECAR = "sidecar"  # the section of SidecarConfig's fields
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def type_name(value_or_type: Any) -> str:
    """'an integer', 'a string', ... for a value or a type, in error messages."""
    t = value_or_type if isinstance(value_or_type, type) else type(value_or_type)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a table", list: "a list", type(None): "nothing"}
    return names.get(t, t.__name__)


def explain(key: Key, problem: str) -> str:
    """``problem`` with the values ``key`` allows, unless it already says them."""
    return problem if "must be" in problem else f"{problem}; allowed: {key.allowed()}"


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {short(text)}")


@dataclass(frozen=True)
class Key:
    """A key of one section; ``path`` is how messages and ``--set`` name it."""

    section: str
    name: str
    default: Any

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        """``KVSIDECAR_<FIELD>`` for a sidecar field, ``KVSIDECAR_<SECTION>_<KEY>`` else."""
        tail = self.name if self.section == SIDECAR else f"{self.section}_{self.name}"
        return ENV_PREFIX + tail.upper()

    def allowed(self) -> str:
        """The values this key allows, for messages and ``config show``."""
        raise NotImplementedError

    def from_toml(self, value: Any) -> Any:
        """The value a TOML file gave, checked; raises ``ValueError`` (no key in it)."""
        raise NotImplementedError

    def from_text(self, text: str) -> Any:
        """The value an environment variable or ``--set`` gave, parsed and checked."""
        raise NotImplementedError

    def check(self, value: Any) -> str | None:
        """What the limits table says of an already parsed value (a flag given on the
        command line): ``None`` when it is allowed."""
        return None


@dataclass(frozen=True)
class FieldKey(Key):
    """A SidecarConfig field: checked against its annotation and its :class:`Limit`."""

    hint: Any = Any
    limit: Limit | None = None

    def allowed(self) -> str:
        if self.limit is None:
            return _hint_name(self.hint)
        if self.limit.choices is not None:
            return self.limit.describe()
        return f"{_hint_name(self.hint)} {self.limit.describe()}"

    def from_toml(self, value: Any) -> Any:
        checked = _check(value, self.hint)
        problem = self.limit.problem(checked) if self.limit else None
        if problem:
            raise ValueError(problem)
        return checked

    def from_text(self, text: str) -> Any:
        return self.from_toml(_from_text(text, self.hint))

    def check(self, value: Any) -> str | None:
        return self.limit.problem(value) if self.limit else None


@dataclass(frozen=True)
class FlagKey(Key):
    """A subcommand's flag; ``flag`` is its option string (``--sample-every``)."""

    flag: str = ""
    action: argparse.Action | None = field(default=None, compare=False, hash=False)
    # sidecar.config.settings.LIMITS[path], else FLAG_DEFAULT for numbers
    limit: Limit | None = None

    @property
    def kind(self) -> str:
        a = self.action
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return "bool"
        if isinstance(a, argparse._AppendAction) or (a is not None and a.nargs in ("+", "*")):
            return "list"
        return "value"

    def allowed(self) -> str:
        a = self.action
        if self.kind == "bool":
            return "true or false"
        if a is not None and a.choices:
            what = f"one of {', '.join(map(str, a.choices))}"
        elif a is not None and a.type in (int, float):
            what = type_name(a.type)
        elif a is not None and a.type is None:
            what = "a string"
        elif self.default is not None and not isinstance(self.default, list):
            what = f"{type_name(self.default)} that {self.flag} accepts"
        else:
            what = f"a value that {self.flag} accepts"
        return f"a list of {what}" if self.kind == "list" else what

    def from_toml(self, value: Any) -> Any:
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {type_name(value)}")
            return value
        if self.kind == "list":
            if not isinstance(value, list):
                raise ValueError(f"expected a list, got {type_name(value)}")
            return [self._one(v) for v in value]
        return self._one(value)

    def from_text(self, text: str) -> Any:
        if self.kind == "bool":
            return parse_bool(text)
        if self.kind == "list":
            return [self._parse(t) for t in text.replace(",", " ").split()]
        return self._parse(text)

    def _one(self, value: Any) -> Any:
        """A TOML scalar: parsed by the flag's type, and of the type that parse yields."""
        if isinstance(value, dict | list):
            raise ValueError(f"expected a single value, got {type_name(value)}")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        result = self._parse(text)
        same = (type(result) is type(value)
                or (isinstance(result, float) and type(value) is int))
        if not same:
            raise ValueError(f"expected {type_name(result)}, got {type_name(value)} "
                             f"{short(value)}")
        return result

    def _parse(self, text: str) -> Any:
        a = self.action
        parse = a.type if a is not None and callable(a.type) else str
        try:
            result = parse(text)
        except (ValueError, TypeError, OverflowError, argparse.ArgumentTypeError) as exc:
            message = str(exc)
            if isinstance(exc, ValueError) and parse in (int, float):
                message = f"expected {type_name(parse)}, got {short(text)}"
            raise ValueError(message) from None
        if a is not None and a.choices and result not in a.choices:
            raise ValueError(f"must be one of {', '.join(map(str, a.choices))}, "
                             f"got {short(result)}")
        problem = self.problem(result)
        if problem:
            raise ValueError(problem)
        return result

    def check(self, value: Any) -> str | None:
        for item in value if isinstance(value, list) else [value]:
            problem = self.problem(item)
            if problem:
                return problem
        return None

    def problem(self, value: Any) -> str | None:
        """What the limits table says of one parsed numeric value (``None``: fine); text
        must hold no NUL character (no path, name or URL does)."""
        if isinstance(value, str):
            return text_problem(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {short(value)}"
        return (self.limit or FLAG_DEFAULT).problem(value)


def _hint_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_hint_name(a) for a in args if a is not type(None))
    if origin is dict:
        return f"a table (values: {_hint_name(args[1])})" if args else "a table"
    if origin in (list, tuple):
        return f"a list (items: {_hint_name(args[0])})" if args else "a list"
    return "any value" if hint is Any else type_name(hint)


def _check(value: Any, hint: Any) -> Any:
    """``value`` if it is of type ``hint`` (an int widened to float), else ``ValueError``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"must be one of {', '.join(map(str, args))}, got {short(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # an optional value: the member's own words
            return _check(value, members[0])
        for member in members:
            try:
                return _check(value, member)
            except ValueError:
                continue
        raise ValueError(f"expected {_hint_name(hint)}, got {type_name(value)} {short(value)}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table, got {type_name(value)} {short(value)}")
        kt, vt = args or (Any, Any)
        return {_check(k, kt): _check(v, vt) for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {type_name(value)} {short(value)}")
        items = [_check(v, args[0] if args else Any) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer of 400 digits
            raise ValueError(f"must be a finite number, got {short(value)}") from None
    if hint in (int, float) and isinstance(value, bool):
        raise ValueError(f"expected {type_name(hint)}, got {type_name(value)} {short(value)}")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"expected {type_name(hint)}, got {type_name(value)} {short(value)}")
    problem = text_problem(value) if isinstance(value, str) else None
    if problem:
        raise ValueError(problem)
    return value


def text_problem(text: str) -> str | None:
    """What is wrong with a text value whatever its key (``None``: fine): no path, name or
    URL holds a NUL character, and the OS refuses one with a traceback far from the key."""
    return "must not contain a NUL character" if "\x00" in text else None


def _from_text(text: str, hint: Any) -> Any:
    """Text (an environment variable, ``--set``) as a value of ``hint``, before the check."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("", "none"):
            return None
        members = [a for a in args if a is not type(None)]
        hint = members[0] if len(members) == 1 else Any
        origin = typing.get_origin(hint)
    if hint is bool:
        return parse_bool(text)
    if hint in (int, float):
        try:
            return hint(text.strip())
        except ValueError:
            raise ValueError(f"expected {type_name(hint)}, got {short(text)}") from None
    if origin in (dict, list, tuple) or hint is Any:
        try:  # a TOML value: {float32 = 1e-3}, [1, 2], 3
            return parse_toml(f"v = {text}", "value")["v"]
        except FileProblem:
            if hint is Any:
                return text
            raise ValueError(f"expected {_hint_name(hint)} in TOML syntax (e.g. "
                             f"{{float32 = 1e-3}}), got {short(text)}") from None
    return text
