"""Issue 21 break 2: configuration that passed ``config check`` but blinded or crashed the
sidecar, and files that made the reader hang or raise. Every case: exit 2, one line naming
the problem."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import typing

import pytest

from sidecar.cli.main import main
from sidecar.config.layers import read_file
from sidecar.config.schema import _field_hints, build_schema
from sidecar.config.settings import DAY_S, LIMITS, SidecarConfig
from sidecar.config.toml_file import MAX_CONFIG_BYTES


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-sidecar: error: "), err[-2000:]
    assert "Traceback" not in err and len(lines[0]) < 600, lines[0][:600]
    return lines[0]


def _numeric(hint: typing.Any) -> bool:
    """int, float, or Optional of one (a table of numbers is checked by its own code)."""
    if typing.get_origin(hint) is not None and typing.get_origin(hint) is not typing.Union \
            and not str(typing.get_origin(hint)).endswith("UnionType'>"):
        return False
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return any(a in (int, float) for a in args)


def test_every_numeric_field_is_bounded_by_the_one_table() -> None:
    for f in dataclasses.fields(SidecarConfig):
        if not _numeric(_field_hints()[f.name]) or _field_hints()[f.name] is bool:
            continue
        limit = LIMITS.get(f.name)
        assert limit is not None and limit.low is not None and limit.high is not None, f.name
        if f.name.endswith("_s") and not f.name.endswith("_per_s"):  # a duration
            assert limit.high <= DAY_S, f.name


@pytest.mark.parametrize("toml, says", [
    ("adapter_timeout_s = inf", "sidecar.adapter_timeout_s: must be >= 0.001 and <= 3600, got inf"),
    ("allocator_every_s = inf", "sidecar.allocator_every_s: must be >= 0 and <= 86400"),
    ("scrub_every_s = inf", "sidecar.scrub_every_s: must be > 0 and <= 86400, got inf"),
    ("scrub_every_s = 1e300", "sidecar.scrub_every_s: must be > 0 and <= 86400"),
    ("breaker_window_s = nan", "sidecar.breaker_window_s: must be"),
    ("seed = 1" + "0" * 400, "sidecar.seed: must be >="),
    ("adapter_timeout_s = 1" + "0" * 400, "sidecar.adapter_timeout_s: must be a finite"),
    ("queue_size = 1" + "0" * 30, "sidecar.queue_size: must be >= 1 and <= 1000000"),
    # Values that passed `config check` yet blinded the demo (outside check): every call
    # timed out, the budget never refilled, a tolerance no error could exceed.
    ("adapter_timeout_s = 1e-300", "sidecar.adapter_timeout_s: must be >= 0.001"),
    ("recompute_tokens_per_s = 1e-300", "recompute_tokens_per_s must be <= 0 (unlimited) or >= 1"),
    ("tolerances = { float32 = 1e30 }", "must be a number > 0 and <= 1"),
])
def test_infinite_and_huge_numbers_are_refused(tmp_path, capsys, toml, says) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[sidecar]\n{toml}\n")
    assert main(["config", "check", str(path)]) == 2
    assert says in _one_error_line(capsys.readouterr().err)


def test_env_1e400_and_explicit_inf_flags_are_refused(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVSIDECAR_ADAPTER_TIMEOUT_S", "1e400")
    assert main(["config", "show"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "KVSIDECAR_ADAPTER_TIMEOUT_S (sidecar.adapter_timeout_s): must be >= 0.001" in line
    # the demo, on 75d8333, then verified 0 blocks and exited 0 with a fault injected
    assert main(["demo", "--fault", "zero-block", "--requests", "10"]) == 2
    assert "KVSIDECAR_ADAPTER_TIMEOUT_S" in _one_error_line(capsys.readouterr().err)
    monkeypatch.delenv("KVSIDECAR_ADAPTER_TIMEOUT_S")
    assert main(["demo", "--hold", "inf", "--requests", "1"]) == 2  # a flag: same table
    assert "demo.hold" in _one_error_line(capsys.readouterr().err)


def _write(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


HOSTILE = {
    "non_utf8": (b"[sidecar]\nseed = 1 # \xff\xfe\n", "is not UTF-8 text"),
    "nesting_5000": (b"[sidecar]\ntolerances = " + b"[" * 5000 + b"]" * 5000 + b"\n",
                     "nested too deeply"),
    "inline_nesting_5000": (b"[sidecar]\ntolerances = " + b"{a=" * 5000 + b"1" +
                            b"}" * 5000 + b"\n", "nested too deeply"),
    "digits_5000": (b"[sidecar]\nseed = " + b"1" * 5000 + b"\n", "TOML cannot hold"),
    "dotted_40k": (b"a" + b".a" * 20000 + b" = 1\n", "has 20000 dots; at most 4096"),
    "dotted_line": (b"a" + b".a" * 100 + b" = 1\n", "line 1 has 100 dots; at most 64"),
    "many_dotted_lines": (b"".join(b"k%d" % i + b".a" * 63 + b" = 1\n" for i in range(1500)),
                          "dots; at most 4096"),
    "too_big": (b"# " + b"x" * (MAX_CONFIG_BYTES + 10) + b"\n", "bytes; at most"),
    "nul_bytes": (b"[sidecar]\nseed = 1\x00\n", "not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_are_one_line_and_exit_2(tmp_path, capsys, case) -> None:
    data, says = HOSTILE[case]
    path = _write(tmp_path, f"{case}.toml", data)
    assert main(["config", "check", path]) == 2
    assert says in _one_error_line(capsys.readouterr().err)
    assert main(["demo", "--config", path, "--requests", "1"]) == 2  # every command
    assert says in _one_error_line(capsys.readouterr().err)


def test_directories_and_special_files_are_refused_without_reading(tmp_path, capsys) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    schema = build_schema()
    for path, says in [(str(tmp_path), "is a directory"), (str(fifo), "not a regular file"),
                       ("/dev/zero", "not a regular file"), ("/dev/null", "not a regular")]:
        got: list[list[str]] = []
        # On 75d8333 the FIFO blocked the reader for ever: wait with a cap, in a thread.
        t = threading.Thread(target=lambda p=path, out=got: out.append(read_file(schema, p)[1]),
                             daemon=True)
        t.start()
        t.join(60)
        assert got and len(got[0]) == 1 and says in got[0][0], (path, got)
    assert main(["config", "check", str(fifo)]) == 2
    assert "not a regular file" in _one_error_line(capsys.readouterr().err)


def test_dev_zero_via_the_environment_exits_2_without_growing(tmp_path) -> None:
    """On 75d8333 ``/dev/zero`` as the file was read whole (it never ends); run in a child
    with an address-space cap so the old behaviour fails rather than eats the machine."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30));"
            "from sidecar.cli.main import main; sys.exit(main(['config', 'show']))")
    env = {**os.environ, "KVSIDECAR_CONFIG": "/dev/zero"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "/dev/zero is not a regular file" in _one_error_line(proc.stderr)


def test_a_nul_in_a_text_value_is_refused_by_config_check(tmp_path, capsys) -> None:
    """An outside check: evidence_dir = "\\u0000x" passed `config check`, then the demo died
    with a traceback (embedded null byte) creating the directory."""
    path = _write(tmp_path, "nul.toml", b'[sidecar]\nevidence_dir = "\\u0000x"\n')
    assert main(["config", "check", path]) == 2
    assert "evidence_dir: must not contain a NUL character" in capsys.readouterr().err
    assert main(["demo", "--config", path, "--requests", "1", "--port", "0", "--quiet"]) == 2


@pytest.mark.parametrize("toml, flags, says", [
    ('token_range = "500:3"', ["--token-range", "500:3"],
     "must be LO:HI with 0 <= LO < HI, got '500:3'"),
    ('token_range = "a:b"', ["--token-range", "a:b"], "must be LO:HI with 0 <= LO < HI"),
    ("min_rate = 5.0\nmax_rate = 2.0", ["--min-rate", "5", "--max-rate", "2"],
     "min_rate must not exceed max_rate, got 5 > 2"),
    ("fraction = 0.0", ["--fraction", "0"], "must be > 0 and <= 1, got 0"),
    ("max_rate = 0.0", ["--max-rate", "0"], "must be > 0 and <= 1e+06, got 0"),
])
def test_config_check_refuses_what_the_canary_refuses(tmp_path, capsys, toml, flags,
                                                      says) -> None:
    """An outside check: ``[canary] token_range = "500:3"`` passed `config check`, then
    `kv-sidecar canary` refused it. The canary's rules (the flag's type, the limits table,
    its one rule across keys) are what config check, the file, the env and flags apply."""
    path = _write(tmp_path, "canary.toml", f"[canary]\n{toml}\n".encode())
    assert main(["config", "check", path]) == 2
    assert says in _one_error_line(capsys.readouterr().err)
    endpoint = ["canary", "--endpoint", "http://127.0.0.1:1/v1", "--pairs", "1"]
    assert main([*endpoint, "--config", path]) == 2
    assert says in _one_error_line(capsys.readouterr().err)
    try:
        rc = main([*endpoint, *flags])
    except SystemExit as exc:  # argparse: the flag's type refused it
        rc = exc.code
    assert rc == 2 and says in capsys.readouterr().err.splitlines()[-1]


def test_the_canary_rule_names_the_key_set_outside_its_default(tmp_path, capsys,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("KVSIDECAR_CANARY_MAX_RATE", "0.01")  # under the default min_rate
    assert main(["config", "show"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("kv-sidecar: error: canary.max_rate: min_rate must not exceed "
                           "max_rate, got 0.05 > 0.01 (KVSIDECAR_CANARY_MAX_RATE)"), line


@pytest.mark.parametrize("toml, says", [
    ('fault = "nonexistent"', "unknown fault 'nonexistent'; known: none, zero-block"),
    ('device = "tpu"', "expected cpu, cuda or cuda:N (N = 0..127, no leading zero), got 'tpu'"),
    ('device = "cuda:-1"', "expected cpu, cuda or cuda:N (N = 0..127, no leading zero), got "
                           "'cuda:-1'"),
    ('device = "cuda:01"', "got 'cuda:01'"),  # outside check: torch refuses it
    ('device = "cuda:999"', "got 'cuda:999'"),  # torch wraps it to cuda:-25
    ('device = "cuda:99999999999999999999"', "no leading zero), got 'cuda:9999"),
])
def test_config_check_refuses_what_the_demo_refuses(tmp_path, capsys, toml, says) -> None:
    """An outside check: ``[demo] fault = "nonexistent"`` and ``device = "tpu"`` passed
    `config check`, then the demo refused them. The flags' types are the one rule."""
    path = _write(tmp_path, "demo.toml", f"[demo]\n{toml}\n".encode())
    assert main(["config", "check", path]) == 2
    assert says in _one_error_line(capsys.readouterr().err)
    assert main(["demo", "--config", path, "--requests", "1", "--port", "0", "--quiet"]) == 2
    assert says in _one_error_line(capsys.readouterr().err)
