"""Issue 23's acceptance line for the demo, with the shipped defaults (calibration on, the
reference engine's shipped profile, the demo's 1-in-4 sampling): `kv-sidecar demo --fault
storage-downcast --dtype bfloat16` is caught, and a clean demo stays quiet in every dtype.
Only the port, the output format and (for the clean runs) the workload size are set."""

from __future__ import annotations

import json

import pytest

from sidecar.cli.main import main


def _demo(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["demo", "--port", "0", "--json", "--quiet", *args]) == 0
    summary: dict = json.loads(capsys.readouterr().out)
    return summary


def test_fp8_storage_downcast_in_bfloat16_is_caught_as_shipped(
        capsys: pytest.CaptureFixture[str]) -> None:
    s = _demo(capsys, "--fault", "storage-downcast", "--dtype", "bfloat16")
    assert s["fault_injections"] > 0
    assert s["anomalies"].get("recompute_mismatch", 0) > 0
    assert s["first_content_anomaly_request"] >= s["fault_start_request"]
    # The tolerance in use is the shipped profile's, under fp8's smallest error (~0.1).
    assert s["tolerance"] < 0.096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_clean_demo_stays_quiet_in_every_dtype(capsys: pytest.CaptureFixture[str],
                                                 dtype: str) -> None:
    s = _demo(capsys, "--dtype", dtype, "--requests", "200")
    assert s["verified"] > 0 and s["hits"] > 0
    assert s["anomalies"] == {} and s["anomaly_rate"] == 0.0
    assert s["invariant_violations"] == {} and not s["leak_suspected"]


def test_a_run_that_verified_nothing_does_not_say_clean(capsys) -> None:
    """An outside check: sampling so sparse that nothing is verified printed "clean" beside an
    injected fault; it says the check never ran."""
    assert main(["demo", "--fault", "zero-block", "--requests", "30", "--port", "0", "--quiet",
                 "--sample-every", "100000000", "--set", "sidecar.burst_hits=0"]) == 0
    out = capsys.readouterr().out
    assert "NOT CHECKED: no block was verified" in out and "clean:" not in out
