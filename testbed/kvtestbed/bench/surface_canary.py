"""Canary surface of ``kv-sidecar bench reliability``: the canary's client and loop against
a hostile server on 127.0.0.1 (:mod:`kvtestbed.bench.hostile_http`): mutated answers,
trickled, endless, silent, redirecting, dropped and oversized ones.

A case is answered when the client either returned a :class:`Completion` whose every
number is what the comparison may use (finite logprobs in range, counts in range) or
raised :class:`RequestFailed` with a known reason and a message; it hung when it took
past its deadline plus a grace. Then a long-running canary (``pairs=0``) is run over a
server whose answers are one in three malformed: it must still be running at the end, with
every pair either compared or counted as an error.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from typing import Any

from kvtestbed.bench.fuzz import mutate_bytes
from kvtestbed.bench.hostile_http import Answer, HostileServer, completion, honest
from kvtestbed.bench.surface_evidence import mutate_obj
from kvtestbed.bench.surfaces import SurfaceResult
from sidecar.canary.answers import LOGPROB_RANGE, MAX_COUNT
from sidecar.canary.client import Completion, OpenAIClient, RequestFailed
from sidecar.canary.endpoint import parse_endpoint

REASONS = {"connect", "http", "protocol", "timeout"}
DEADLINE_S = 0.5  # the client's whole-request deadline in this bench
GRACE_S = 2.0  # past deadline + grace: a hang
CAP = 256 * 1024  # the client's answer cap in this bench (the default is 16 MiB)


def _valid() -> dict[str, Any]:
    return completion([{"token_id:1": -0.1, "token_id:2": -2.5},
                       {"token_id:3": -0.2, "token_id:4": -1.0}], cached=4, prompt=8)


def _hostile_answer(rng: random.Random) -> Answer:
    r = rng.random()
    if r < 0.002:
        return Answer(body=json.dumps(_valid()).encode(), mode="trickle", trickle_s=0.2)
    if r < 0.004:
        return Answer(mode="endless")
    if r < 0.006:
        return Answer(mode="silent")
    if r < 0.03:
        return Answer(status=rng.choice((301, 302, 307, 308)), body=b"",
                      headers={"Location": "http://10.1.2.3/v1/completions"})
    if r < 0.05:
        return Answer(mode="close")
    if r < 0.07:
        return Answer(status=rng.choice((500, 502, 503, 429)), body=b'{"error": "x"}')
    if r < 0.08:
        return Answer(body=b" " * (CAP + 1))
    if r < 0.1:
        return Answer(body=json.dumps(_valid()).encode())
    try:
        if r < 0.7:
            return Answer(body=json.dumps(mutate_obj(_valid(), rng), default=str).encode())
    except (TypeError, ValueError, RecursionError):
        pass
    return Answer(body=mutate_bytes(json.dumps(_valid()).encode(), rng))


def _consistent(c: Completion) -> bool:
    lo, hi = LOGPROB_RANGE
    return (all(isinstance(t, str) for t in c.tokens)
            and all(isinstance(v, float) and math.isfinite(v) and lo <= v <= hi
                    for top in c.top_logprobs for v in top.values())
            and 0 <= c.prompt_tokens < MAX_COUNT
            and (c.cached_tokens is None or 0 <= c.cached_tokens < MAX_COUNT))


def canary_server(quick: bool, seed: int) -> SurfaceResult:
    n = 300 if quick else 10_000
    res = SurfaceResult("canary_server", "malformed, trickled, endless, silent, "
                        "redirecting, dropped, oversized answers -> canary client and loop",
                        min_cases=n)
    rng = random.Random(seed)
    pending: list[Answer] = []
    reasons: dict[str, int] = {}
    completions = 0

    def script(method: str, path: str, body: Any) -> Answer:
        return pending.pop() if pending else honest(method, path, body)

    with HostileServer(script) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), model="hostile",
                              timeout_s=DEADLINE_S, max_answer_bytes=CAP)
        client.token_id_keys = False
        for _ in range(n):
            pending[:] = [_hostile_answer(rng)]
            res.cases += 1
            started = time.monotonic()
            try:
                c = client.complete([1, 2, 3, 4, 5, 6, 7, 8], 2, 2)
                ok = _consistent(c)
                completions += ok
            except RequestFailed as exc:
                ok = exc.reason in REASONS and bool(str(exc))
                reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            except Exception:
                res.escaped += 1
                continue
            if time.monotonic() - started > DEADLINE_S + GRACE_S:
                res.hangs += 1
            res.answered += ok
        res.figures.update(completions=completions, errors=reasons)
        _long_running(res, srv.endpoint, rng, 20 if quick else 200)
    return res


def _long_running(res: SurfaceResult, endpoint: str, rng: random.Random, pairs: int) -> None:
    """A ``--pairs 0`` canary over answers one in three malformed: keeps going, and every
    pair is compared or counted."""
    from sidecar.canary.load import RateLimit
    from sidecar.canary.runner import Canary, CanaryConfig

    served = {"n": 0}

    def script(method: str, path: str, body: Any) -> Answer:
        if path.endswith("/completions"):
            served["n"] += 1
            if served["n"] > 2 and rng.random() < 0.33:
                return _hostile_answer(rng)
        return honest(method, path, body)

    with HostileServer(script) as srv:
        client = OpenAIClient(parse_endpoint(srv.endpoint), timeout_s=DEADLINE_S,
                              max_answer_bytes=CAP)
        canary = Canary(client, CanaryConfig(dtype="float32", block_size=4, pairs=0,
                                             calibration=1, metrics_every=1000,
                                             rate=RateLimit(min_rate=1e6, max_rate=1e6)))
        canary.preflight()
        stop, done = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["report"] = canary.run(stop)
            except BaseException as exc:
                outcome["error"] = repr(exc)
            done.set()

        threading.Thread(target=run, name="bench-canary", daemon=True).start()
        deadline = time.monotonic() + 120 + pairs * 3 * (DEADLINE_S + GRACE_S)
        while not done.is_set() and canary.report.pairs < pairs and \
                time.monotonic() < deadline:
            done.wait(0.05)
        still_running = not done.is_set()
        stop.set()
        done.wait(60)
    report = canary.report
    res.cases += report.pairs
    errors = sum(report.errors.values())
    res.answered += min(report.pairs, len(report.divergences) + errors)
    res.check(still_running and "error" not in outcome,
              f"long-running canary still running after {report.pairs} pairs "
              f"({outcome.get('error', 'ok')})")
    res.check(len(report.divergences) + errors == report.pairs,
              "every long-running pair compared or counted")
    res.check(report.pairs >= pairs, f"long-running canary reached {pairs} pairs")
    res.figures["long_running"] = {"pairs": report.pairs, "compared": len(report.divergences),
                                   "errors": dict(report.errors)}
