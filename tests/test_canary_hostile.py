"""Issue 21 break 6: the canary never trusts the server. Against a hostile server on
127.0.0.1 (kvtestbed.bench.hostile_http): every malformed answer is a counted probe error
(one-shot: exit 2 with the reason; long-running: it keeps going), a trickled answer times
out at the request's deadline, an endless body stops at the size cap, a redirect is an
error that says where it points."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from typing import Any

import pytest
from kvtestbed.bench.hostile_http import Answer, HostileServer, completion, honest

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient, RequestFailed
from sidecar.canary.endpoint import parse_endpoint
from sidecar.canary.load import RateLimit
from sidecar.canary.runner import Canary, CanaryConfig
from sidecar.cli.main import main

GOOD_TOP = {"token_id:1": -0.5, "token_id:2": -1.5}


def _body(obj: Any) -> Answer:
    return Answer(body=obj if isinstance(obj, bytes) else json.dumps(obj).encode())


def _usage(**usage: Any) -> dict[str, Any]:
    out = completion([GOOD_TOP])
    out["usage"] = usage
    return out


MALFORMED = {
    "logprob abc": completion([{"token_id:1": "abc"}]),
    "logprob NaN": b'{"choices": [{"logprobs": {"tokens": ["a"], "top_logprobs": '
                   b'[{"a": NaN}]}}]}',
    "logprob 1e400": b'{"choices": [{"logprobs": {"tokens": ["a"], "top_logprobs": '
                     b'[{"a": -1e400}]}}]}',
    "logprob huge int": b'{"choices": [{"logprobs": {"tokens": ["a"], "top_logprobs": '
                        b'[{"a": -' + b"9" * 5000 + b"}]}}]}",
    "logprob list": completion([{"token_id:1": [1]}]),
    "logprob positive": completion([{"token_id:1": 3.0}]),
    "top_logprobs dict": {"choices": [{"logprobs": {"tokens": [], "top_logprobs": {"a": 1}}}]},
    "tokens not strings": {"choices": [{"logprobs": {"tokens": [{"x": 1}],
                                                     "top_logprobs": [GOOD_TOP]}}]},
    "usage list": {**completion([GOOD_TOP]), "usage": [1, 2]},
    "prompt_tokens abc": _usage(prompt_tokens="abc"),
    "cached_tokens -1": _usage(prompt_tokens=8, prompt_tokens_details={"cached_tokens": -1}),
    "details string": _usage(prompt_tokens=8, prompt_tokens_details="x"),
    "choices missing": {"id": "x"},
    "body a list": [1, 2, 3],
    "not JSON": b"<html>hello</html>",
    "deep JSON": b"[" * 200_000 + b"]" * 200_000,
}


def _after_preflight(bad: Answer) -> Any:
    """Honest for the preflight and the cache_salt check, ``bad`` for every pair."""
    seen = {"completions": 0}

    def script(method: str, path: str, body: Any) -> Answer:
        if path.endswith("/completions"):
            seen["completions"] += 1
            if seen["completions"] > 2:
                return bad
        return honest(method, path, body)

    return script


def _cli(endpoint: str, *extra: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["canary", "--endpoint", endpoint, "--dtype", "float32", "--block-size",
                   "4", "--min-rate", "1000", "--max-rate", "1000", "--timeout", "10",
                   "--calibration", "1", *extra])
    return rc, err.getvalue()


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_one_shot_run_with_a_malformed_answer_exits_2_with_the_reason(name) -> None:
    with HostileServer(_after_preflight(_body(MALFORMED[name]))) as srv:
        rc, err = _cli(srv.endpoint, "--pairs", "2")
    assert rc == 2, err
    assert "protocol" in err and "Traceback" not in err, err


def _canary(endpoint: str, pairs: int, timeout: float = 10.0) -> Canary:
    client = OpenAIClient(parse_endpoint(endpoint), timeout_s=timeout)
    canary = Canary(client, CanaryConfig(dtype="float32", block_size=4, pairs=pairs,
                                         calibration=1,
                                         rate=RateLimit(min_rate=1000, max_rate=1000)))
    canary.preflight()
    return canary


def test_long_running_canary_counts_bad_answers_and_keeps_going() -> None:
    names = sorted(MALFORMED)
    served = {"n": 0, "bad": 0}

    def script(method: str, path: str, body: Any) -> Answer:
        if path.endswith("/completions"):
            served["n"] += 1
            # after preflight + salt check: every 4th request is malformed
            if served["n"] > 2 and served["n"] % 4 == 0:
                served["bad"] += 1
                return _body(MALFORMED[names[served["bad"] % len(names)]])
        return honest(method, path, body)

    with HostileServer(script) as srv:
        canary = _canary(srv.endpoint, pairs=0)
        stop = threading.Event()
        done = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["report"] = canary.run(stop)
            except BaseException as exc:  # what the test is about: it must not end so
                result["error"] = exc
            done.set()

        threading.Thread(target=run, daemon=True).start()
        while not done.is_set() and canary.report.pairs < 30:
            done.wait(0.05)
        stop.set()
        done.wait(60)
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report.pairs >= 30
    assert report.errors.get("protocol", 0) >= 5 and len(report.divergences) >= 5
    assert report.errors["protocol"] + len(report.divergences) == report.pairs
    m = canary.exporter.metrics
    assert m.value(S.CANARY_ERRORS.name, reason="protocol") == report.errors["protocol"]


def test_a_trickled_answer_times_out_at_the_deadline_not_per_read() -> None:
    body = json.dumps(completion([GOOD_TOP])).encode()
    with HostileServer(lambda m, p, b: Answer(body=body, mode="trickle", trickle_s=0.2)) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="m", timeout_s=1.0)
        with pytest.raises(RequestFailed) as info:
            client.complete([1, 2, 3], 1, 2)
    assert info.value.reason == "timeout"


def test_a_silent_server_times_out() -> None:
    with HostileServer(lambda m, p, b: Answer(mode="silent")) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="m", timeout_s=0.5)
        with pytest.raises(RequestFailed) as info:
            client.complete([1, 2, 3], 1, 2)
    assert info.value.reason == "timeout"


def test_an_endless_body_stops_at_the_size_cap() -> None:
    with HostileServer(lambda m, p, b: Answer(mode="endless")) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="m", timeout_s=60,
                              max_answer_bytes=2**20)
        with pytest.raises(RequestFailed) as info:
            client.complete([1, 2, 3], 1, 2)
    assert info.value.reason == "protocol" and "limit" in str(info.value)


def test_a_declared_oversized_body_is_refused_before_reading() -> None:
    big = Answer(body=b" " * (2**20 + 1))
    with HostileServer(lambda m, p, b: big) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="m",
                              max_answer_bytes=2**20)
        with pytest.raises(RequestFailed, match="over the"):
            client.complete([1, 2, 3], 1, 2)


def test_a_redirect_is_an_http_error_not_followed() -> None:
    moved = Answer(status=302, body=b"", headers={"Location": "http://10.0.0.1/v1/x"})
    with HostileServer(lambda m, p, b: moved) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="m")
        with pytest.raises(RequestFailed) as info:
            client.complete([1, 2, 3], 1, 2)
        assert srv.requests == 1
    assert info.value.reason == "http" and "302" in str(info.value)


def test_a_malformed_models_list_is_exit_2() -> None:
    bad = Answer(body=b'{"data": [{"id": {"nested": 1}}]}')
    with HostileServer(lambda m, p, b: bad if p.endswith("/models") else honest(m, p, b)) \
            as srv:
        rc, err = _cli(srv.endpoint, "--pairs", "1")
    assert rc == 2 and "lists no model" in err
