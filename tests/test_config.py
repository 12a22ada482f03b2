"""One configuration: a TOML file, ``KVSIDECAR_*`` environment variables and flags
(flags > env > file > defaults), ``kv-sidecar config check|show``, ``--config`` on the
commands that run the sidecar.

Most cases call the CLI's entry point (``sidecar.cli.main.main``) in-process; two run it as a
subprocess (the real interpreter start, and the lean install without the vLLM extra).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import sidecar.config.schema as schema_mod
from sidecar.cli.main import build_parser, main
from sidecar.config.cli import configure, sidecar_config
from sidecar.config.layers import ConfigError
from sidecar.config.settings import LIMITS, SidecarConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kv-sidecar.toml"


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch):
    """No KVSIDECAR_* from the caller's shell leaks into a case."""
    import os

    for var in [v for v in os.environ if v.startswith("KVSIDECAR_")]:
        monkeypatch.delenv(var)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kv-sidecar.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("toml", "key", "says"), [
    ("[sidecar]\nsmaple_every = 10\n", "sidecar.smaple_every", "did you mean sidecar.sample_every"),
    ("[sidecar]\nqueue_size = \"64\"\n", "sidecar.queue_size", "expected an integer"),
    ("[sidecar]\nrecompute = 1\n", "sidecar.recompute", "expected true or false"),
    ("[sidecar]\nlifecycle_sample_rate = 1.5\n", "sidecar.lifecycle_sample_rate",
     "must be >= 0 and <= 1, got 1.5"),
    ("[sidecar]\ndispatch = \"parallel\"\n", "sidecar.dispatch",
     "one of queued, inline, deferred"),
    ("[sidecar]\ntolerances = {float64 = 1e-3}\n", "sidecar.tolerances", "float64"),
    ("[demo]\nport = 70000\n", "demo.port", "must be 0..65535"),
    ("[demo]\nrequests = 2.5\n", "demo.requests", "expected a whole number"),
    ("[canary]\npairs = \"3\"\n", "canary.pairs", "expected an integer, got a string"),
    ("[vllm]\nreference = \"gpu\"\n", "vllm.reference", "one of engine, hf, none"),
    ("[demo]\nnope = 1\n", "demo.nope", "known keys in [demo]"),
    ("[sidecarr]\nseed = 1\n", "[sidecarr]", "sections: [sidecar]"),
    ("sample_every = 10\n", "sample_every", "put it under [sidecar]"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path, capsys, toml, key, says):
    path = _write(tmp_path, toml)
    assert main(["config", "check", path]) == 2
    err = capsys.readouterr().err
    assert key in err and says in err, err
    assert "Traceback" not in err
    # a command given the same file refuses it the same way, before running anything
    assert main(["demo", "--config", path]) == 2
    assert key in capsys.readouterr().err


def test_check_lists_every_error_at_once(tmp_path, capsys):
    path = _write(tmp_path, "[sidecar]\nqueue_size = 0\nleak_window = 1\n"
                            "[demo]\nhold = -1.0\n[canary]\nmode = \"x\"\n")
    assert main(["config", "check", path]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    named = ["sidecar.queue_size", "sidecar.leak_window", "demo.hold", "canary.mode"]
    assert len(lines) == len(named)
    for key, line in zip(named, lines, strict=True):
        assert key in line and "must be" in line, line


def test_not_toml_and_missing_file_exit_2(tmp_path, capsys):
    assert main(["config", "check", _write(tmp_path, "[sidecar\n")]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    assert main(["config", "check", str(tmp_path / "absent.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_example_file_is_valid_and_every_key_counted(capsys):
    assert main(["config", "check", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    data = tomllib.loads(EXAMPLE.read_text())
    n = sum(len(t) for t in data.values())
    assert f"ok; {n} keys set" in out
    for section, table in data.items():
        for name in table:
            assert f"  {section}.{name} = " in out


def test_real_entry_point_exit_codes(tmp_path):
    bad = _write(tmp_path, "[sidecar]\nsample_every = 0\n")
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "config", "check", bad],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sidecar.sample_every: must be >= 1 and <= 100000000000, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr  # exit 0 through a subprocess: the lean case below


def test_bad_env_value_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("KVSIDECAR_SAMPLE_EVERY", "often")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "KVSIDECAR_SAMPLE_EVERY (sidecar.sample_every): expected an integer" in err
    monkeypatch.setenv("KVSIDECAR_SAMPLE_EVERY", "0")
    assert main(["demo", "--requests", "5"]) == 2
    assert "KVSIDECAR_SAMPLE_EVERY (sidecar.sample_every): must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("KVSIDECAR_SAMPLE_EVERY", "5")
    monkeypatch.setenv("KVSIDECAR_DEMO_OTEL", "otlp")
    assert main(["config", "show"]) == 2
    assert "KVSIDECAR_DEMO_OTEL (demo.otel): must be one of none, console" in \
        capsys.readouterr().err


def test_unknown_env_variable_is_warned_not_fatal(monkeypatch, capsys):
    monkeypatch.setenv("KVSIDECAR_SAMPLE_EVRY", "5")
    assert main(["config", "show"]) == 0
    assert "KVSIDECAR_SAMPLE_EVRY (did you mean KVSIDECAR_SAMPLE_EVERY?)" in \
        capsys.readouterr().out


def _show(capsys, *argv: str) -> dict:
    assert main(["config", "show", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_precedence_and_provenance_in_show(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path, "[sidecar]\nsample_every = 10\nqueue_size = 16\n"
                            "[vllm]\nport = 9500\n")
    shown = _show(capsys)
    assert shown["sidecar.sample_every"] == {"value": 1000, "source": "default", "origin": ""}
    shown = _show(capsys, "--config", path)
    assert shown["sidecar.sample_every"] == {"value": 10, "source": "file", "origin": path}
    assert shown["vllm.port"]["value"] == 9500 and shown["vllm.port"]["source"] == "file"
    monkeypatch.setenv("KVSIDECAR_SAMPLE_EVERY", "20")
    monkeypatch.setenv("KVSIDECAR_VLLM_PORT", "9501")
    shown = _show(capsys, "--config", path)
    assert shown["sidecar.sample_every"] == {"value": 20, "source": "env",
                                             "origin": "KVSIDECAR_SAMPLE_EVERY"}
    assert shown["vllm.port"]["value"] == 9501
    assert shown["sidecar.queue_size"]["source"] == "file"  # untouched keys keep theirs
    shown = _show(capsys, "--config", path, "--set", "sidecar.sample_every=30")
    assert shown["sidecar.sample_every"] == {"value": 30, "source": "flag",
                                             "origin": "--set sidecar.sample_every"}
    # the config file from the environment, when --config is absent
    monkeypatch.setenv("KVSIDECAR_CONFIG", path)
    monkeypatch.delenv("KVSIDECAR_SAMPLE_EVERY")
    assert _show(capsys)["sidecar.queue_size"] == {"value": 16, "source": "file",
                                                   "origin": path}
    # a command's own default for the [sidecar] keys its flags set
    monkeypatch.delenv("KVSIDECAR_CONFIG")
    assert _show(capsys, "--for", "demo")["sidecar.sample_every"]["value"] == 4
    assert main(["config", "show"]) == 0
    table = capsys.readouterr().out
    assert "sample_every" in table and "default" in table and "[canary]" in table


def _configure(argv: list[str], env: dict[str, str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    effective = configure(argv[0], argv[0], parser, argv, args, env=env)
    return args, effective


def test_a_command_takes_flag_over_env_over_file_over_default(tmp_path):
    path = _write(tmp_path, "[sidecar]\nsample_every = 8\nqueue_size = 16\n"
                            "tolerances = {float32 = 2e-3}\n[demo]\nrequests = 30\nhold = 1.5\n")
    args, eff = _configure(["demo", "--config", path], {})
    assert (args.requests, args.sample_every, args.hold, args.port) == (30, 8, 1.5, 9464)
    assert args.tolerance == [("float32", 2e-3)]
    assert args.sidecar_overrides == {"queue_size": 16}
    assert eff["demo.requests"].source == "file" and eff["demo.port"].source == "default"
    env = {"KVSIDECAR_DEMO_REQUESTS": "40", "KVSIDECAR_SAMPLE_EVERY": "6"}
    args, eff = _configure(["demo", "--config", path], env)
    assert (args.requests, args.sample_every) == (40, 6)
    assert eff["sidecar.sample_every"].origin == "KVSIDECAR_SAMPLE_EVERY"
    # an explicit flag wins even when it repeats the default
    args, eff = _configure(["demo", "--config", path, "--requests", "400",
                            "--sample-every=5"], env)
    assert (args.requests, args.sample_every) == (400, 5)
    assert (eff["demo.requests"].source, eff["demo.requests"].origin) == ("flag", "--requests")
    assert eff["sidecar.sample_every"].origin == "--sample-every"
    with pytest.raises(ConfigError, match=r"KVSIDECAR_DEMO_DTYPE \(demo\.dtype\): must be one of"):
        _configure(["demo"], {"KVSIDECAR_DEMO_DTYPE": "float64"})


def test_demo_runs_with_the_file_values(tmp_path, capsys):
    path = _write(tmp_path, "[sidecar]\nsample_every = 3\n"
                            "[demo]\nrequests = 12\nport = 0\nquiet = true\njson = true\n")
    assert main(["demo", "--config", path]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 12 and summary["sample_every"] == 3


def test_required_flags_can_come_from_the_file(tmp_path, capsys):
    assert main(["canary"]) == 2
    assert "--endpoint is required (or canary.endpoint in the config file or " \
           "KVSIDECAR_CANARY_ENDPOINT)" in capsys.readouterr().err
    path = _write(tmp_path, "[canary]\nendpoint = \"http://127.0.0.1:9/v1\"\npairs = 1\n"
                            "timeout = 2.0\n")
    assert main(["canary", "--config", path]) == 2  # now it gets as far as the server
    assert "connection refused by http://127.0.0.1:9" in capsys.readouterr().err


def test_vllm_engine_args_take_sidecar_keys(tmp_path, capsys):
    from sidecar.adapters.vllm.cli import main as vllm_main

    path = _write(tmp_path, "[sidecar]\nsample_every = 7\nseed = 3\n")
    assert vllm_main(["engine-args", "--config", path, "--probe", "ipc:///tmp/p.sock",
                      "--blocks-per-sample", "4"]) == 0
    flags = capsys.readouterr().out
    extra = json.loads(flags.split("'")[1])["kv_connector_extra_config"]
    assert (extra["sample_every"], extra["seed"], extra["blocks_per_sample"]) == (7, 3, 4)
    assert vllm_main(["serve", "--dtype", "float32", "--block-size", "16"]) == 2
    assert "--model is required (or vllm.model in the config file or KVSIDECAR_VLLM_MODEL)" \
        in capsys.readouterr().err
    assert vllm_main(["serve", "--config", _write(tmp_path, "[vllm]\nblock_size = \"16\"\n")]) == 2
    assert "vllm.block_size: expected an integer, got a string" in capsys.readouterr().err


def test_fields_added_to_sidecar_config_are_keys_with_no_extra_code(monkeypatch, tmp_path):
    grown = dataclasses.make_dataclass(
        "SidecarConfig", [("scrub_interval_s", float, dataclasses.field(default=60.0)),
                          ("quarantine", bool, dataclasses.field(default=False))],
        bases=(SidecarConfig,))
    monkeypatch.setattr(schema_mod, "SidecarConfig", grown)
    schema = schema_mod.build_schema()
    assert schema.key("sidecar.scrub_interval_s").default == 60.0
    assert schema.by_env["KVSIDECAR_QUARANTINE"].path == "sidecar.quarantine"
    from sidecar.config.layers import read_file

    values, problems = read_file(schema, _write(tmp_path, "[sidecar]\nscrub_interval_s = 30\n"
                                                           "quarantine = \"yes\"\n"))
    assert values["sidecar.scrub_interval_s"].value == 30.0
    assert len(problems) == 1 and "sidecar.quarantine: expected true or false" in problems[0]


def test_one_table_and_no_env_name_collisions():
    schema = schema_mod.build_schema()
    assert schema.env_collisions == []
    fields = {f.name for f in dataclasses.fields(SidecarConfig)}
    flag_keys = {f"{section}.{name}" for section, keys in schema.sections.items()
                 if section != "sidecar" for name in keys}
    assert {n for n in LIMITS if "." not in n} <= fields
    assert {n for n in LIMITS if "." in n} <= flag_keys  # numeric flag keys, same table
    with pytest.raises(ValueError, match="leak_window must be >= 2 and <= 1000000, got 1"):
        SidecarConfig(leak_window=1).validate()


def test_sidecar_config_for_in_process_embedding(tmp_path):
    path = _write(tmp_path, "[sidecar]\nsample_every = 50\ncapture = false\n")
    cfg = sidecar_config(path, env={"KVSIDECAR_QUEUE_SIZE": "8"}, seed=9)
    assert (cfg.sample_every, cfg.capture, cfg.queue_size, cfg.seed) == (50, False, 8, 9)
    with pytest.raises(ConfigError, match="KVSIDECAR_QUEUE_SIZE"):
        sidecar_config(path, env={"KVSIDECAR_QUEUE_SIZE": "-1"})


def test_without_the_vllm_extra_its_section_is_skipped_not_fatal():
    code = ("import sys\nfor m in ('zmq', 'msgpack'): sys.modules[m] = None\n"
            "from sidecar.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "config", "check", str(EXAMPLE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[vllm] not checked here" in proc.stdout and "kv-sidecar[events]" in proc.stdout
