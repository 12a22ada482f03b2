"""Where each configuration value comes from: defaults < file < environment < flags.

A :class:`Schema` is the sections and their keys (:mod:`sidecar.config.key_table`); this module
reads the three layers over it (a TOML file, ``KVSIDECAR_*`` variables, flags), checks every
value, and merges them into :class:`Value` records that remember their source, so that
``kv-sidecar config show`` can say where each effective value came from. Every problem
found is collected and raised at once (:class:`ConfigError`), each naming its key.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.config.key_table import ENV_PREFIX, Key, explain
from sidecar.config.toml_file import FileProblem, read_toml

log = logging.getLogger(__name__)

SOURCES = ("default", "file", "env", "flag")  # lowest precedence first
# KVSIDECAR_* variables that are not configuration keys (read by their own code).
RESERVED_ENV = frozenset({"KVSIDECAR_CONFIG", "KVSIDECAR_TOKEN",
                          "KVSIDECAR_REQUIRE_PROMETHEUS",
                          "KVSIDECAR_SGLANG_TAP"})  # the SGLang tap's, in the engine
CONFIG_ENV = "KVSIDECAR_CONFIG"  # the config file when no --config is given


class ConfigError(Exception):
    """Bad configuration: one line per problem, each naming its key (CLI exit code 2)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = [one_line(p) for p in problems]
        super().__init__("\n".join(problems))


MAX_PROBLEM_CHARS = 400


def one_line(problem: str) -> str:
    """``problem`` as one printable line of bounded length (a value quoted in it may hold
    newlines, control characters or 40 KB)."""
    flat = "".join(c if c.isprintable() else " " for c in problem)
    if len(flat) > MAX_PROBLEM_CHARS:
        flat = flat[:MAX_PROBLEM_CHARS] + f"... ({len(flat)} characters)"
    return flat


@dataclass(frozen=True)
class Value:
    """An effective value, its source (one of :data:`SOURCES`) and where exactly it came
    from (the file, the variable, the flag)."""

    key: Key
    value: Any
    source: str
    origin: str = ""


class Schema:
    """The sections of a configuration and their keys."""

    def __init__(self, sections: Mapping[str, Mapping[str, Key]],
                 unavailable: Mapping[str, str] | None = None) -> None:
        self.sections = {s: dict(keys) for s, keys in sections.items()}
        # sections whose keys this install cannot know (a missing extra): section -> why
        self.unavailable = dict(unavailable or {})
        self.by_env: dict[str, Key] = {}
        self.env_collisions: list[str] = []
        for key in self.keys():
            if key.env in self.by_env:
                self.env_collisions.append(f"{key.env}: {self.by_env[key.env].path}, "
                                           f"{key.path}")
            self.by_env[key.env] = key

    def keys(self) -> Iterator[Key]:
        for keys in self.sections.values():
            yield from keys.values()

    def key(self, path: str) -> Key | None:
        section, _, name = path.partition(".")
        return self.sections.get(section, {}).get(name)

    def unknown(self, section: str, name: str) -> str:
        """The message for an unknown key: a close match and the keys the section has."""
        known = sorted(self.sections[section])
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {section}.{close[0]}?" if close else ""
        return f"unknown key {section}.{name}{hint} (known keys in [{section}]: " \
               f"{', '.join(known)})"


@dataclass
class Layers:
    """What the file, the environment and the flags set (each path at most once per layer),
    and the ``KVSIDECAR_*`` variables that name no key (warned about, not fatal: other
    tools may share the prefix)."""

    file: dict[str, Value] = field(default_factory=dict)
    env: dict[str, Value] = field(default_factory=dict)
    flag: dict[str, Value] = field(default_factory=dict)
    ignored_env: list[str] = field(default_factory=list)
    path: str | None = None
    problems: list[str] = field(default_factory=list)  # the values left out for them

    def value(self, key: Key, default: Any) -> Value:
        """The highest-precedence value of ``key``; ``default`` when no layer sets it."""
        for layer in (self.flag, self.env, self.file):
            if key.path in layer:
                return layer[key.path]
        return Value(key, default, "default")

    def effective(self, keys: Iterable[Key],
                  defaults: Mapping[str, Any] | None = None) -> dict[str, Value]:
        """Every key's effective value; ``defaults`` (by path) replace the keys' own."""
        defaults = defaults or {}
        return {k.path: self.value(k, defaults.get(k.path, k.default)) for k in keys}


def read_file(schema: Schema, path: str | Path) -> tuple[dict[str, Value], list[str]]:
    """The values a TOML file sets, and the problems in it."""
    name = str(path)
    try:
        data = read_toml(path)  # a regular UTF-8 file, size-capped, hostile TOML refused
    except FileProblem as exc:
        return {}, [str(exc)]
    values: dict[str, Value] = {}
    problems: list[str] = []
    for section, table in data.items():
        if section in schema.unavailable:
            log.warning("[%s] in %s not checked: %s", section, name, schema.unavailable[section])
            continue
        if section not in schema.sections:
            problems.append(_unknown_section(schema, section, table, name))
            continue
        if not isinstance(table, dict):
            problems.append(f"{section}: expected a [{section}] table, got a value ({name})")
            continue
        for key_name, raw in table.items():
            key = schema.sections[section].get(key_name)
            if key is None:
                problems.append(f"{schema.unknown(section, key_name)} ({name})")
                continue
            try:
                values[key.path] = Value(key, key.from_toml(raw), "file", name)
            except ValueError as exc:
                problems.append(f"{key.path}: {explain(key, str(exc))} ({name})")
    return values, problems


def _unknown_section(schema: Schema, section: str, value: Any, file: str) -> str:
    known = ", ".join(f"[{s}]" for s in [*schema.sections, *schema.unavailable])
    owners = [s for s, keys in schema.sections.items() if section in keys]
    if not isinstance(value, dict) and owners:
        return (f"{section}: a key outside any section; put it under [{owners[0]}] "
                f"({file}; sections: {known})")
    return f"unknown section [{section}] ({file}; sections: {known})"


def read_env(schema: Schema, env: Mapping[str, str]
             ) -> tuple[dict[str, Value], list[str], list[str]]:
    """The values ``KVSIDECAR_*`` variables set, the problems, and the variables ignored."""
    values: dict[str, Value] = {}
    problems: list[str] = []
    ignored: list[str] = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        key = schema.by_env.get(var)
        if key is None:
            close = difflib.get_close_matches(var, list(schema.by_env), n=1)
            ignored.append(var + (f" (did you mean {close[0]}?)" if close else ""))
            continue
        try:
            values[key.path] = Value(key, key.from_text(env[var]), "env", var)
        except ValueError as exc:
            problems.append(f"{var} ({key.path}): {explain(key, str(exc))}")
    return values, problems, ignored


def read_sets(schema: Schema, items: Iterable[str]) -> tuple[dict[str, Value], list[str]]:
    """``--set SECTION.KEY=VALUE`` flags (VALUE parsed like an environment variable)."""
    values: dict[str, Value] = {}
    problems: list[str] = []
    for item in items:
        path, sep, text = item.partition("=")
        path = path.strip()
        key = schema.key(path)
        if not sep:
            problems.append(f"--set {item!r}: expected SECTION.KEY=VALUE")
        elif key is None:
            section, _, name = path.partition(".")
            problems.append(f"--set: {schema.unknown(section, name)}" if section in
                            schema.sections else f"--set: unknown key {path} (sections: "
                            f"{', '.join(schema.sections)})")
        else:
            try:
                values[path] = Value(key, key.from_text(text), "flag", f"--set {path}")
            except ValueError as exc:
                problems.append(f"--set {path}: {explain(key, str(exc))}")
    return values, problems


def load(schema: Schema, path: str | Path | None, env: Mapping[str, str],
         sets: Iterable[str] = (), strict: bool = True) -> Layers:
    """All three layers, or (``strict``) :class:`ConfigError` listing every problem in any
    of them; not strict, the problems are in ``Layers.problems`` and their values left out.
    Without ``path`` the file is ``$KVSIDECAR_CONFIG`` when set, else none."""
    path = path if path is not None else (env.get(CONFIG_ENV) or None)
    layers = Layers(path=str(path) if path is not None else None)
    problems: list[str] = []
    if path is not None:
        layers.file, found = read_file(schema, path)
        problems += found
    layers.env, found, layers.ignored_env = read_env(schema, env)
    problems += found
    layers.flag, found = read_sets(schema, sets)
    problems += found
    layers.problems = problems
    if problems and strict:
        raise ConfigError(problems)
    for var in layers.ignored_env:
        log.warning("ignoring %s: not a configuration key", var)
    return layers
