"""Config files and ``KVSIDECAR_*`` variables for ``kv-sidecar bench reliability`` (issue
21): generated hostile cases, each "checked and answered": either accepted and valid (a
:class:`SidecarConfig` that validates, every number finite) or refused with one line per
problem (:class:`ConfigError`). Anything else is a traceback (escaped); a case slower than
:data:`CASE_DEADLINE_S` is a hang (lost).
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtestbed.bench.fuzz import FuzzResult

CASE_DEADLINE_S = 5.0
_NUMBERS = ["inf", "-inf", "nan", "+inf", "1e400", "-1e400", "1" + "0" * 400, "1" * 5000,
            "0", "-1", "1e308", "0x7fffffffffffffff", "9223372036854775808", "1_000",
            "3.5", "-0.0", "1e-400", "2", "86401", "1e15"]
_VALUES = ["true", '"x"', "[]", "{}", '"' + "y" * 5000 + '"', "[1, 2]", "{float32 = 1e-3}",
           "{float32 = inf}", "{float32 = -1}", '{"" = 1}', "1979-05-27", "[[[]]]",
           "[" * 300 + "]" * 300, "{a = {b = {c = 1}}}", "'''\n'''", '"\\u0000"']


def _keys() -> tuple[list[Any], Any]:
    from sidecar.config.schema import build_schema

    schema = build_schema()
    return list(schema.keys()), schema


def _value(rng: random.Random) -> str:
    return rng.choice(_NUMBERS) if rng.random() < 0.6 else rng.choice(_VALUES)


def _file_text(rng: random.Random, keys: list[Any]) -> bytes:
    """A TOML file: real sections and keys with hostile values, and hostile structure."""
    kind = rng.random()
    if kind < 0.7:
        lines: list[str] = []
        section = None
        for _ in range(rng.randint(1, 4)):
            key = rng.choice(keys)
            if key.section != section:
                section = key.section
                lines.append(f"[{section}]")
            lines.append(f"{key.name} = {_value(rng)}")
        text = "\n".join(lines) + "\n"
        return text.encode()
    depth = rng.choice((100, 999, 5000, 20000))
    hostile = [
        lambda: b"[sidecar]\nseed = 1 # " + bytes(rng.randrange(128, 256) for _ in range(4)),
        lambda: b"[sidecar]\ntolerances = " + b"[" * depth + b"]" * depth,
        lambda: b"[sidecar]\ntolerances = " + b"{a=" * depth + b"1" + b"}" * depth,
        lambda: b"a" + b".a" * rng.choice((63, 65, 20000)) + b" = 1\n",
        lambda: b"[" + b"a." * rng.choice((10, 2000)) + b"a]\n",
        lambda: b"[sidecar]\nseed = 1\x00\n",
        lambda: b"\xef\xbb\xbf[sidecar]\nseed = 1\n",  # a UTF-8 BOM
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))),
        lambda: b"# " + b"x" * (300 * 1024),
        lambda: b"[sidecar]\nseed = 1\n[sidecar]\nseed = 2\n",
        lambda: b"sidecar = 1\n",
        lambda: b"[sidecar.deeper]\nx = 1\n",
    ]
    return rng.choice(hostile)()


def _env(rng: random.Random, keys: list[Any]) -> dict[str, str]:
    env = {}
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(keys)
        value = _value(rng) if rng.random() < 0.8 else rng.choice(
            ["", " ", "\t", "a" + ".a" * 20000, "{" * 3000, "\udcff".encode(
                "utf-8", "surrogateescape").decode("utf-8", "replace")])
        env[key.env] = value
    if rng.random() < 0.1:
        env["KVSIDECAR_NOT_A_KEY"] = "1"
    return env


def _answered(load_case: Any) -> str:
    """"accepted", "refused", or raises (a traceback: escaped)."""
    from sidecar.config.layers import ConfigError
    from sidecar.config.settings import SidecarConfig

    try:
        values = load_case()
    except ConfigError as exc:
        lines = exc.problems
        if not lines or any("\n" in p or len(p) > 1000 or not p.strip() for p in lines):
            raise AssertionError(f"refused without one clear line per problem: "
                                 f"{lines!r:.200}") from None
        return "refused"
    config = SidecarConfig(**values)
    config.validate()
    for name, value in vars(config).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise AssertionError(f"accepted a non-finite {name}")
    return "accepted"


def fuzz_config(n: int, seed: int = 0) -> tuple[FuzzResult, FuzzResult]:
    """``n`` hostile files (plus directories and special files) and ``n`` hostile
    environments, through the layers every command loads (file, env, ``[sidecar]``
    checks)."""
    from sidecar.config.cli import sidecar_problems
    from sidecar.config.layers import ConfigError, load

    keys, schema = _keys()
    sidecar_keys = list(schema.sections["sidecar"].values())
    rng = random.Random(seed)
    files = FuzzResult("config_files", "hostile values for every key (inf, nan, 1e400, "
                                       "5,000 digits, nesting to 20,000, 40 KB dotted keys, "
                                       "non-UTF-8, NUL, 300 KB, a directory, a FIFO, "
                                       "/dev/zero, a symlink to it)")
    env = FuzzResult("config_env", "hostile KVSIDECAR_* values for every key (inf, 1e400, "
                                   "5,000 digits, blank, 40 KB, unknown variables)")
    outcomes = {"files": {"accepted": 0, "refused": 0}, "env": {"accepted": 0, "refused": 0}}

    def through(path: str | None, environ: dict[str, str]) -> dict[str, Any]:
        layers = load(schema, path, environ)
        problems = sidecar_problems(schema, layers)
        if problems:
            raise ConfigError(problems)
        return {k.name: layers.value(k, k.default).value for k in sidecar_keys}

    with tempfile.TemporaryDirectory(prefix="kvsidecar-cfgfuzz-") as tmp:
        special = _special_files(Path(tmp))
        target = os.path.join(tmp, "case.toml")
        for i in range(n):
            files.cases += 1
            if i < len(special):
                path = special[i]
            else:
                path = target
                with open(target, "wb") as f:
                    f.write(_file_text(rng, keys))
            _run(files, outcomes["files"], lambda p=path: through(p, {}))
        for _ in range(n):
            env.cases += 1
            environ = _env(rng, keys)
            _run(env, outcomes["env"], lambda e=environ: through(None, e))
    files.tried += f" ({outcomes['files']['accepted']} accepted and valid, " \
                   f"{outcomes['files']['refused']} refused with one line each)"
    env.tried += f" ({outcomes['env']['accepted']} accepted and valid, " \
                 f"{outcomes['env']['refused']} refused with one line each)"
    return files, env


def _run(res: FuzzResult, outcomes: dict[str, int], case: Any) -> None:
    started = time.monotonic()
    try:
        outcomes[_answered(case)] += 1
        answered = True
    except Exception:
        res.escaped += 1
        answered = False
    if time.monotonic() - started > CASE_DEADLINE_S:
        res.lost += 1  # a hang past the deadline
    elif answered:
        res.survived += 1


def _special_files(tmp: Path) -> list[str]:
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    link = tmp / "zero.toml"
    link.symlink_to("/dev/zero")
    (tmp / "dir.toml").mkdir()
    (tmp / "empty.toml").write_bytes(b"")
    return [str(fifo), str(link), "/dev/zero", "/dev/null", str(tmp / "dir.toml"),
            str(tmp / "empty.toml"), str(tmp / "missing.toml"), str(tmp / "nul\x00.toml")]
