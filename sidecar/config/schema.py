"""The configuration's sections, derived from the code that owns each setting.

* ``[sidecar]``: every :class:`~sidecar.config.settings.SidecarConfig` field (a field added at the
  end of the dataclass is a key, with no code here);
* ``[demo]``, ``[vllm]``, ``[canary]``: the flags of ``kv-sidecar demo``, of
  ``kv-sidecar vllm serve`` and ``vllm engine-args``, and of ``kv-sidecar canary``: a key
  per flag, named like the flag (``--hold`` -> ``hold``), checked by the flag's own type.

A flag that sets a SidecarConfig field (``demo --sample-every``, ``vllm serve
--adapter-timeout``) is not a key of its command's section: it sets ``[sidecar]``'s key,
and its own default is that command's default for it (the demo samples 1 in 4, production 1
in 1000). :data:`SIDECAR_FLAGS` is that table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.cli.testbed_hook import TESTBED_MISSING, testbed_parsers
from sidecar.config.key_table import SIDECAR, FieldKey, FlagKey, Key
from sidecar.config.layers import Schema
from sidecar.config.settings import LIMITS, SidecarConfig
from sidecar.core.extras import MissingExtra, require

# Flags that are about the configuration itself, or about argparse: never keys.
NOT_KEYS = frozenset({"help", "version", "config", "set", "config_required"})


def _commands(register: Callable[[Any], None]) -> argparse.ArgumentParser:
    """A parser holding the subcommands ``register(subparsers)`` adds: each command module
    registers its own flags, and the schema derives from those, never from the CLI (which
    configures itself from the schema)."""
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p


def _demo_parser() -> argparse.ArgumentParser:
    parsers = testbed_parsers()
    if parsers is None:
        raise ImportError(TESTBED_MISSING.format(command="demo"))
    return _commands(lambda sub: parsers.add_parser(sub, "demo"))


def _canary_parser() -> argparse.ArgumentParser:
    from sidecar.canary.cli import add_parser

    return _commands(add_parser)


def _canary_check(values: Mapping[str, Any]) -> str | None:
    from sidecar.canary.cli import settings_problem

    return settings_problem(values)


def _guard_parser() -> argparse.ArgumentParser:
    from sidecar.protect.cli import add_parser

    return _commands(add_parser)


def _vllm_parser() -> argparse.ArgumentParser:
    from sidecar.adapters.vllm.arguments import parser

    return parser()


@dataclass(frozen=True)
class Command:
    """A command that takes ``--config``: its section, the parser that holds it and the
    names of its subparsers there, and which of its flags set SidecarConfig fields."""

    section: str
    parser: Callable[[], argparse.ArgumentParser]
    subcommands: tuple[str, ...]
    sidecar_flags: Mapping[str, str]  # flag dest -> SidecarConfig field
    # The command's rule across its keys (key -> value; a problem or None), which no one
    # flag's type sees: config check and configure apply the command's own function.
    check: Callable[[Mapping[str, Any]], str | None] | None = None


_TOLERANCE_FLAGS = {"tolerance": "tolerances", "calibrate": "calibration_samples",
                    "calibration_multiple": "calibration_multiple",
                    "calibration_profile": "calibration_profile"}
COMMANDS: dict[str, Command] = {
    "demo": Command("demo", _demo_parser, ("demo",),
                    {"sample_every": "sample_every", "evidence_dir": "evidence_dir",
                     **_TOLERANCE_FLAGS}),
    "vllm": Command("vllm", _vllm_parser, ("serve", "engine-args"),
                    {"blocks_per_sample": "blocks_per_sample", "sample_every": "sample_every",
                     "seed": "seed", "adapter_timeout": "adapter_timeout_s",
                     "recompute_budget": "recompute_tokens_per_s", **_TOLERANCE_FLAGS}),
    "canary": Command("canary", _canary_parser, ("canary",), {}, check=_canary_check),
    "guard": Command("guard", _guard_parser, ("guard",), {}),  # sidecar/protect/cli.py
}


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise KeyError(f"no subcommand {name!r}")


def flag_actions(p: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The optional flags of one subparser that can be configuration keys."""
    for action in p._actions:
        if action.option_strings and action.dest not in NOT_KEYS \
                and not isinstance(action, argparse._SubParsersAction):
            yield action


def _field_hints() -> dict[str, Any]:
    try:
        return typing.get_type_hints(SidecarConfig)
    except (NameError, TypeError):  # a field typed with a name only a type checker sees
        module = vars(sys.modules[SidecarConfig.__module__])
        hints: dict[str, Any] = {}
        for f in dataclasses.fields(SidecarConfig):
            try:
                hints[f.name] = eval(f.type, module) if isinstance(f.type, str) else f.type
            except Exception:  # unresolvable: no type check, the default's type at least
                hints[f.name] = Any
        return hints


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def sidecar_keys() -> dict[str, Key]:
    """``[sidecar]``: one key per SidecarConfig field."""
    hints = _field_hints()
    return {f.name: FieldKey(SIDECAR, f.name, field_default(f), hint=hints.get(f.name, Any),
                             limit=LIMITS.get(f.name))
            for f in dataclasses.fields(SidecarConfig)}


def command_keys(command: Command) -> dict[str, Key]:
    """A command's section: its flags, less those that set SidecarConfig fields."""
    keys: dict[str, Key] = {}
    top = command.parser()
    for name in command.subcommands:
        for action in flag_actions(subparser(top, name)):
            if action.dest in command.sidecar_flags or action.dest in keys:
                continue
            flag = max(action.option_strings, key=len)
            keys[action.dest] = FlagKey(command.section, action.dest, action.default,
                                        flag=flag, action=action,
                                        limit=LIMITS.get(f"{command.section}.{action.dest}"))
    return keys


def command_defaults(command: Command) -> dict[str, Any]:
    """The command's own defaults for the ``[sidecar]`` keys its flags set."""
    defaults: dict[str, Any] = {}
    top = command.parser()
    for name in command.subcommands:
        for action in flag_actions(subparser(top, name)):
            fld = command.sidecar_flags.get(action.dest)
            if fld is not None:
                defaults.setdefault(f"{SIDECAR}.{fld}", sidecar_value(action.default))
    return defaults


def sidecar_value(flag_value: Any) -> Any:
    """A mapped flag's value as its SidecarConfig field holds it (``--tolerance`` pairs ->
    a table)."""
    if isinstance(flag_value, list) and all(isinstance(v, tuple) and len(v) == 2
                                            for v in flag_value):
        return dict(flag_value)
    return flag_value


def flag_value(action: argparse.Action, value: Any) -> Any:
    """The inverse of :func:`sidecar_value`: a SidecarConfig value in the flag's shape."""
    if isinstance(action, argparse._AppendAction) and isinstance(value, dict):
        return list(value.items())
    return value


def build_schema() -> Schema:
    """Every section: ``[sidecar]`` then each command's."""
    sections: dict[str, dict[str, Key]] = {SIDECAR: sidecar_keys()}
    unavailable: dict[str, str] = {}
    for command in COMMANDS.values():
        try:
            if command.section in EXTRA_OF:
                require(EXTRA_OF[command.section])
            sections[command.section] = command_keys(command)
        except (MissingExtra, ImportError) as exc:  # the lean runtime: no vLLM adapter
            unavailable[command.section] = str(exc)
    return Schema(sections, unavailable)


EXTRA_OF = {"vllm": "vllm"}  # sections whose parser needs an extra (sidecar/core/extras.py)
