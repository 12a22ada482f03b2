"""The configuration reference page, from the one schema builder every command reads.

Keys, types, ranges, defaults and environment names come from
:func:`sidecar.config.schema.build_schema` (the code ``config check`` runs); what a
``[sidecar]`` key means comes from the comments beside its field in
:class:`sidecar.config.settings.SidecarConfig`, what a command key means from its flag's help.
"""

from __future__ import annotations

from typing import Any

from kvtestbed.docs.code_tables import field_comments, md_table
from sidecar.config.key_table import FlagKey, Key
from sidecar.config.schema import COMMANDS, build_schema
from sidecar.config.settings import SidecarConfig


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def _meaning(key: Key, notes: dict[str, str]) -> str:
    if isinstance(key, FlagKey):
        help_text = key.action.help if key.action is not None else ""
        return f"`{key.flag}`: {help_text or ''}".replace("%(default)s", str(key.default))
    return notes.get(key.name, "")


def config_page() -> str:
    schema = build_schema()
    notes = field_comments(SidecarConfig)
    out = ["# Configuration keys", "",
           "Every key of every section, from `sidecar/config/schema.py` (the table "
           "`kv-sidecar config check` checks a file against). Precedence: flags > environment "
           "> file > defaults; `--set SECTION.KEY=VALUE` sets any key at flag level. "
           "How the layers work: [Configuration](../operations/configuration.md).", ""]
    for section, keys in schema.sections.items():
        command = COMMANDS.get(section)
        where = ("every command that reads the file (" + ", ".join(
                     f"`kv-sidecar {c.section} {s}`" if c.section == "vllm"
                     else f"`kv-sidecar {s}`"
                     for c in COMMANDS.values() for s in c.subcommands) + ")"
                 if command is None
                 else "`kv-sidecar " + "`, `kv-sidecar ".join(
                     f"{section} {s}" if section == "vllm" else s
                     for s in command.subcommands) + "`")
        out += [f"## [{section}]", "", f"Read by {where}. {len(keys)} keys.", ""]
        rows = [(f"`{k.name}`", k.allowed(), _default(k.default), f"`{k.env}`",
                 _meaning(k, notes)) for k in keys.values()]
        out += [md_table(("key", "type and range", "default", "environment", "meaning"),
                         rows), ""]
        if command is not None and command.sidecar_flags:
            flags = ", ".join(f"`--{d.replace('_', '-')}` -> `sidecar.{f}`"
                              for d, f in command.sidecar_flags.items())
            out += [f"Flags of this command that set `[sidecar]` keys: {flags}.", ""]
    for section, why in schema.unavailable.items():
        out += [f"## [{section}]", "", f"Not available where this page was generated: {why}",
                ""]
    return "\n".join(out)
