"""``kv-sidecar guard`` from the command line: start-up checks, refused values, the
[guard] config section, and the ``bench perf --guard`` figures."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from sidecar.cli.main import main
from tests.canary_fake import BLOCK, FakeServer


def test_cli_says_at_start_when_the_server_ignores_cache_salt() -> None:
    err, out = io.StringIO(), io.StringIO()
    with FakeServer(salt=False) as fake, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(out):
        rc = main(["guard", "--upstream", f"http://127.0.0.1:{fake.port}", "--listen",
                   "127.0.0.1:0", "--metrics-port", "0", "--dtype", "float32",
                   "--block-size", str(BLOCK), "--calibration", "2", "--duration", "0.01",
                   "--probe-errors", "6"])
    assert rc == 0, err.getvalue()
    assert "ignores cache_salt" in err.getvalue() and "only alert" in err.getvalue()
    status = json.loads(out.getvalue())
    assert status["bypass_supported"] is False and status["probe_errors_to_open"] == 6


def test_an_upstream_given_with_v1_is_told_to_give_the_root(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["guard", "--upstream", "http://127.0.0.1:1/v1/"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give the server's root" in err[0] and "127.0.0.1:1" in err[0]


def test_a_metrics_port_in_use_is_one_line_exit_1() -> None:
    import socket

    err = io.StringIO()
    with socket.socket() as busy, FakeServer() as fake, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = main(["guard", "--upstream", f"http://127.0.0.1:{fake.port}", "--listen",
                   "127.0.0.1:0", "--metrics-port", str(busy.getsockname()[1]), "--dtype",
                   "float32", "--block-size", str(BLOCK), "--calibration", "2",
                   "--duration", "0.01"])
    lines = [ln for ln in err.getvalue().splitlines() if "kv-sidecar guard: error" in ln]
    assert rc == 1 and len(lines) == 1 and "cannot serve metrics" in lines[0], err.getvalue()
    assert "Traceback" not in err.getvalue()


@pytest.mark.parametrize("flags", [["--hold", "nan"], ["--hold", "inf"], ["--probes", "0"],
                                   ["--listen", "nohost"], ["--max-body-bytes", "-1"],
                                   ["--sidecar-status", "notaurl"],
                                   ["--sidecar-status", "ftp://127.0.0.1/status"],
                                   ["--sidecar-status", "http://127.0.0.1:99999/status"]])
def test_cli_refuses_bad_values(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["guard", "--upstream", "http://127.0.0.1:1", *flags])
    assert exc.value.code == 2


def test_cli_refuses_a_public_listen_address_without_a_token(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSIDECAR_TOKEN", raising=False)
    rc = main(["guard", "--upstream", "http://127.0.0.1:1", "--listen", "0.0.0.0:0"])
    assert rc == 2 and "token" in capsys.readouterr().err


def test_bench_perf_guard_measures_both_paths_side_by_side() -> None:
    """`bench perf --guard --quick`: the figures exist and are measured, not asserted."""
    from kvtestbed.bench.perf_guard import guard_rows

    raw: dict[str, Any] = {}
    rows = guard_rows(quick=True, repeats=1, raw=raw)
    # throughput, P50, P99, then the CPU per request of guard + stand-in vs the stand-in
    # alone (a row once the stand-in used a clock tick: --quick sends only 40 requests)
    assert [r.figure.split(":")[0] for r in rows] == ["guard closed"] * len(rows)
    assert len(rows) in (3, 4) and all(r.sidecar > 0 and r.baseline > 0 for r in rows)
    assert len(raw["guard"]["pair_ratios"]) == 2 and rows[0].met is not None
    cpu = raw["guard"]["cpu_ms_per_request"]
    assert set(cpu) == {"guard_via_guard", "upstream_via_guard", "upstream_via_direct"}
    assert all(v >= 0 for v in cpu.values())


def test_config_check_knows_the_guard_section(tmp_path: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('[guard]\nupstream = "http://127.0.0.1:8000"\nhold = 30.0\nprobes = 3\n')
    bad.write_text('[guard]\nhold = inf\nworkers = 0\n')
    assert main(["config", "check", str(good)]) == 0
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "guard.hold" in err and "guard.workers" in err


@pytest.mark.parametrize("token", ["t\u00f6k\u00e9n\u2713", "x" * 100_000])
def test_cli_refuses_a_token_no_client_could_send(
        token: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSIDECAR_TOKEN", token)
    assert main(["guard", "--upstream", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-sidecar guard: error: $KVSIDECAR_TOKEN") and err.count("\n") == 1


def test_cli_names_the_guard_when_the_upstream_is_remote(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSIDECAR_TOKEN", raising=False)
    assert main(["guard", "--upstream", "http://192.0.2.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "the guard forwards" in err and "canary" not in err and "--allow-remote" in err


def test_probe_errors_is_a_guard_key_of_file_env_and_flag_bounded_by_the_limits_table(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.config.cli import run_config
    from sidecar.config.settings import LIMITS

    limit = LIMITS["guard.probe_errors"]
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("[guard]\nprobe_errors = 7\n")
    bad.write_text(f"[guard]\nprobe_errors = {int(limit.high or 0) + 1}\n")
    assert main(["config", "check", str(good)]) == 0
    assert main(["config", "check", str(bad)]) == 2
    assert "guard.probe_errors" in capsys.readouterr().err

    def shown(*argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        from sidecar.cli.main import build_parser

        args = build_parser().parse_args(["config", "show", "--json", *argv])
        assert run_config(args, env or {}) == 0
        return dict(json.loads(capsys.readouterr().out)["guard.probe_errors"])

    assert shown("--config", str(good)) == {"value": 7, "source": "file",
                                            "origin": str(good)}
    assert shown(env={"KVSIDECAR_GUARD_PROBE_ERRORS": "9"})["value"] == 9
    assert shown("--set", "guard.probe_errors=4")["value"] == 4
    with pytest.raises(SystemExit):  # the flag: the same bounds
        main(["guard", "--upstream", "http://127.0.0.1:1", "--probe-errors", "0"])
