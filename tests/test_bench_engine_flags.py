"""The real-engine benches refuse a bad flag in one line, exit 2, before looking for the
engine or starting any server. Outside check (stop 48): ``--vllm-fingerprint-every -1`` and
1-in-N values past the sidecar's bound were refused only by a child after the first vLLM
server had started (a traceback and an orphaned server), ``--vllm-concurrency 1e20`` failed
80 s in with an ``OverflowError``, and ``--vllm-requests 0`` silently meant the default."""

from __future__ import annotations

import pytest

from sidecar.cli.main import main

BIG = "99999999999999999999"


@pytest.mark.parametrize(("engine", "flags", "said"), [
    ("vllm", ["--vllm-poll-every", "0"], "--vllm-poll-every must be 0.05..86400 seconds"),
    ("vllm", ["--vllm-poll-every", "nan"], "--vllm-poll-every must be 0.05..86400 seconds"),
    ("vllm", ["--vllm-poll-every", "1e9"], "--vllm-poll-every must be 0.05..86400 seconds"),
    ("vllm", ["--vllm-requests", "0"], "--vllm-requests must be 1..1,000,000, got 0"),
    ("vllm", ["--vllm-concurrency", BIG], "--vllm-concurrency must be 1..1,024"),
    ("vllm", ["--vllm-sample-every", "1000", BIG],
     "--vllm-sample-every must be 1..100,000,000,000"),
    ("vllm", ["--vllm-fingerprint-every", "-1"],
     "--vllm-fingerprint-every must be 0..100,000,000,000, got -1"),
    ("sglang", ["--sglang-requests", "0"], "--sglang-requests must be 1..1,000,000, got 0"),
    ("sglang", ["--sglang-concurrency", BIG], "--sglang-concurrency must be 1..1,024"),
    ("sglang", ["--sglang-sample-every", "0"], "--sglang-sample-every must be 1..100,000"),
])
def test_a_bad_flag_is_one_line_before_any_server(engine: str, flags: list[str], said: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # the engine's interpreter pointing nowhere: the flag is refused first, not the engine
    assert main(["bench", "perf", "--engine", engine, *flags,
                 f"--{engine}-python", "/nonexistent/python"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
