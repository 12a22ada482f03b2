"""``kv-sidecar config check FILE`` and ``kv-sidecar config show``, and what every command
that takes a configuration shares: ``--config FILE``, ``--set SECTION.KEY=VALUE``, and
:func:`configure`, which fills a parsed command line from the layers
(flags > ``KVSIDECAR_*`` environment > file > defaults).

Exit codes: 0 a valid configuration, 2 an invalid one (every problem printed, each naming
its key and the values it allows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar.checks.tolerance import override_problems
from sidecar.config.key_table import SIDECAR
from sidecar.config.layers import CONFIG_ENV, ConfigError, Layers, Schema, Value, load
from sidecar.config.schema import (
    COMMANDS,
    Command,
    build_schema,
    command_defaults,
    flag_actions,
    flag_value,
    sidecar_value,
    subparser,
)
from sidecar.config.settings import SidecarConfig


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set`` on a command's parser. Its required flags become optional
    here (the file or the environment may set them) and :func:`configure` checks them."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"TOML configuration file (default: ${CONFIG_ENV}, else none); "
                        "flags > KVSIDECAR_* environment > file > defaults")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="set any configuration key (repeatable; see `kv-sidecar config show`)")
    required = []
    for action in p._actions:
        if action.required and action.option_strings:
            action.required = False
            required.append(action.dest)
    p.set_defaults(config_required=tuple(required))


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The flags ``argv`` gives explicitly (a flag set to its default value included):
    ``argv`` parsed again with every default suppressed, so that only given flags land in
    the namespace. ``argv`` already parsed once, so this parse cannot fail."""
    saved: list[tuple[Any, str, Any]] = []

    def suppress(p: argparse.ArgumentParser) -> None:
        saved.append((p, "_defaults", p._defaults))
        p._defaults = {}
        for action in p._actions:
            saved.append((action, "default", action.default))
            action.default = argparse.SUPPRESS
            if isinstance(action, argparse._SubParsersAction):
                for sp in action.choices.values():
                    suppress(sp)

    try:
        suppress(parser)
        namespace = parser.parse_args(list(argv))
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
    return set(vars(namespace))


def configure(section: str, subcommand: str, parser: argparse.ArgumentParser,
              argv: Sequence[str], args: argparse.Namespace,
              env: Mapping[str, str] | None = None) -> dict[str, Value]:
    """Fill ``args`` (parsed from ``argv`` by ``parser``) from the configuration: a flag
    not given explicitly takes the environment's or the file's value. Sets
    ``args.sidecar_overrides``: the ``[sidecar]`` keys the layers set that no flag of the
    command covers (the command passes them to its SidecarConfig). Returns the effective
    values of the command's keys; raises :class:`ConfigError`."""
    env = os.environ if env is None else env
    command = COMMANDS[section]
    schema = build_schema()
    layers = load(schema, args.config, env, args.set)
    problems = sidecar_problems(schema, layers)
    explicit = explicit_dests(parser, argv)
    effective: dict[str, Value] = {}
    mapped: set[str] = set()
    for action in flag_actions(subparser(parser, subcommand)):
        fld = command.sidecar_flags.get(action.dest)
        key = schema.key(f"{SIDECAR}.{fld}" if fld else f"{section}.{action.dest}")
        if key is None:
            continue
        mapped.add(key.path)
        current = getattr(args, action.dest)
        if action.dest in explicit:
            value = Value(key, sidecar_value(current), "flag",
                          max(action.option_strings, key=len))
            problem = key.check(value.value)  # the same limits table as file and env
            if problem:
                problems.append(f"{value.origin} ({key.path}): {problem}")
        else:
            value = layers.value(key, sidecar_value(current))
            setattr(args, action.dest, flag_value(action, value.value))
        effective[key.path] = value
    for dest in getattr(args, "config_required", ()):
        if getattr(args, dest, None) is None:
            key = schema.key(f"{section}.{dest}")
            env_name = f" or {key.env}" if key else ""
            problems.append(f"--{dest.replace('_', '-')} is required (or {section}.{dest} "
                            f"in the config file{env_name})")
    if not problems:  # the rule across keys, on values each valid alone
        problems = rule_problems(command, {v.key.name: v for v in effective.values()
                                           if v.key.section == section})
    if problems:
        raise ConfigError(problems)
    overrides = {}
    for key in schema.sections[SIDECAR].values():
        value = layers.value(key, key.default)
        if key.path not in mapped and value.source != "default":
            overrides[key.name] = value.value
            effective[key.path] = value
    args.sidecar_overrides = overrides
    return effective


def sidecar_config(path: str | None = None, env: Mapping[str, str] | None = None,
                   **overrides: Any) -> SidecarConfig:
    """A :class:`SidecarConfig` from ``[sidecar]`` of a config file (default:
    ``$KVSIDECAR_CONFIG``) and ``KVSIDECAR_*``, for code that embeds the sidecar in-process
    (the LMCache monitor, a ``vllm.LLM`` script); keyword ``overrides`` win, like flags.
    Raises :class:`ConfigError`."""
    schema = build_schema()
    layers = load(schema, path, os.environ if env is None else env)
    problems = sidecar_problems(schema, layers)
    if problems:
        raise ConfigError(problems)
    values = {k.name: layers.value(k, k.default).value for k in schema.sections[SIDECAR].values()}
    config = SidecarConfig(**{**values, **overrides})
    config.validate()
    return config


def sidecar_problems(schema: Schema, layers: Layers) -> list[str]:
    """What :meth:`SidecarConfig.validate` refuses in the merged ``[sidecar]`` values (the
    checks across a value's parts: tolerance keys, the calibration)."""
    keys = schema.sections[SIDECAR].values()
    problem, culprits = _culprits({k.name: layers.value(k, k.default) for k in keys},
                                  _invalid)
    if problem is None:
        return []
    if not culprits:
        return [f"[{SIDECAR}] {problem}"]
    out = []
    for v in culprits:  # a tolerances table: each bad entry on its own line
        each = override_problems(v.value) if v.key.name == "tolerances" else []
        out += [f"{v.key.path}: {p} ({v.origin or v.source})" for p in each or [problem]]
    return out


def command_problems(schema: Schema, layers: Layers) -> list[str]:
    """What each command's rule across its keys (``Command.check``) refuses in its
    section's merged values: the rule the command itself applies when it runs."""
    out = []
    for command in COMMANDS.values():
        keys = schema.sections.get(command.section)
        if keys is not None:
            out += rule_problems(command, {n: layers.value(k, k.default)
                                           for n, k in keys.items()})
    return out


def rule_problems(command: Command, values: Mapping[str, Value]) -> list[str]:
    """``command.check`` of ``values`` (key name -> value), each problem naming the keys
    that cause it."""
    if command.check is None:
        return []
    problem, culprits = _culprits(values, command.check)
    if problem is None:
        return []
    if not culprits:
        return [f"[{command.section}] {problem}"]
    return [f"{v.key.path}: {problem} ({v.origin or v.source})" for v in culprits]


def _culprits(values: Mapping[str, Value], invalid: Callable[[dict[str, Any]], str | None]
              ) -> tuple[str | None, list[Value]]:
    """Why ``values`` are refused (``None``: they are not), and the keys to name: those set
    by a layer whose value, put back to its default, makes them valid."""
    problem = invalid({n: v.value for n, v in values.items()})
    if problem is None:
        return None, []
    return problem, [v for n, v in values.items() if v.source != "default"
                     and invalid({m: (w.key.default if m == n else w.value)
                                  for m, w in values.items()}) is None]


def _invalid(values: dict[str, Any]) -> str | None:
    """Why ``SidecarConfig(**values)`` does not validate, or ``None``."""
    try:
        SidecarConfig(**values).validate()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def add_parser(sub: Any) -> None:
    """Register ``config check`` and ``config show`` on the CLI's subparsers."""
    c = sub.add_parser("config", help="check or show the configuration (file, env, flags)",
                       description="One configuration for every command: a TOML file "
                                   "(--config), KVSIDECAR_* environment variables, flags.")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION")
    check = csub.add_parser("check", help="validate a config file: exit 0, or 2 with every "
                                          "error naming its key")
    check.add_argument("file", metavar="FILE")
    show = csub.add_parser("show", help="effective values and where each came from "
                                        "(default, file, env, flag)")
    show.add_argument("--config", metavar="FILE", default=None,
                      help=f"TOML configuration file (default: ${CONFIG_ENV}, else none)")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="a flag-level value (repeatable)")
    show.add_argument("--for", dest="for_command", choices=sorted(COMMANDS), default=None,
                      help="use this command's defaults for the [sidecar] keys its flags set")
    show.add_argument("--json", action="store_true", help="one JSON object")


def run_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        if args.config_command == "check":
            return _check(args.file)
        if args.config_command == "show":
            return _show(args, env)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kv-sidecar: error: {problem}", file=sys.stderr)
        return 2
    print("usage: kv-sidecar config check FILE | config show [--config FILE]",
          file=sys.stderr)
    return 2


def _check(path: str) -> int:
    schema = build_schema()
    layers = load(schema, path, env={}, strict=False)  # the file alone, every problem
    problems = (layers.problems + sidecar_problems(schema, layers)
                + command_problems(schema, layers))
    if problems:
        raise ConfigError(problems)
    per_section: dict[str, int] = {}
    for value in layers.file.values():
        per_section[value.key.section] = per_section.get(value.key.section, 0) + 1
    counts = ", ".join(f"[{s}] {n}" for s, n in per_section.items()) or "nothing"
    print(f"{path}: ok; {len(layers.file)} keys set ({counts})")
    for path_, value in layers.file.items():
        print(f"  {path_} = {_show_value(value.value)}")
    for section, why in schema.unavailable.items():
        print(f"  [{section}] not checked here: {why}")
    return 0


def _show(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    schema = build_schema()
    layers = load(schema, args.config, env, args.set)
    problems = sidecar_problems(schema, layers) + command_problems(schema, layers)
    if problems:
        raise ConfigError(problems)
    defaults = command_defaults(COMMANDS[args.for_command]) if args.for_command else {}
    effective = layers.effective(schema.keys(), defaults)
    if args.json:
        print(json.dumps({p: {"value": v.value, "source": v.source, "origin": v.origin}
                          for p, v in effective.items()}, indent=1, default=str))
        return 0
    print(f"# config file: {layers.path or 'none'}; precedence: flag > env > file > default")
    section = None
    for value in effective.values():
        if value.key.section != section:
            section = value.key.section
            print(f"[{section}]")
        origin = f" ({value.origin})" if value.origin else ""
        print(f"  {value.key.name:<30} {_show_value(value.value):<28} "
              f"{value.source}{origin}")
    for var in layers.ignored_env:
        print(f"# ignored: {var} is not a configuration key")
    return 0


def _show_value(value: Any) -> str:
    return json.dumps(value) if value is not None else "(unset)"
