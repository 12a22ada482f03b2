"""The cache-bypass guard: a pass-through proxy in front of an OpenAI-compatible server that
stops users being served from a cache known to be wrong.

Closed, it forwards every request byte for byte. Open, it adds a fresh ``cache_salt`` to
the JSON body of every POST under ``/v1/`` and of vLLM's ``/invocations``
(:data:`GENERATION_ROUTES`): vLLM keys
a request's first block on its salt, so no cached block can match and the engine serves a
miss (slower, never wrong because of the cache). Half-open, a few probes go with the cache
and their verdicts decide (:mod:`sidecar.protect.breaker`).

What opens it (any of them):

* **local** verdicts: the guard replays 1 in ``verify_every`` requests (every probe while
  half-open) with and without the cache through the canary's
  :class:`~sidecar.canary.replay.ReplayVerifier`: one anomalous verdict opens it;
* a kv-sidecar's ``/status`` (``sidecar_status``): its ``anomalies`` counter rising opens
  it, its ``verified`` counter rising without anomalies are clean verdicts;
* an **Alertmanager webhook** (``POST /guard/alertmanager``): a firing
  ``KVCacheContentAnomaly``, ``KVCacheHighHitRateWithAnomalies`` or
  ``KVCacheAnomalyLocalised`` for this guard's ``instance``, or a fleet-wide
  ``KVCacheAnomalyFleetWide`` for its ``model``;
* an **operator**: ``POST /guard/open``, ``/guard/half-open``, ``/guard/close``.

``/guard/*`` needs ``Authorization: Bearer <token>`` when a token is set (the sidecar's
server rules, :func:`sidecar.export.server.load_token`); ``GET /guard/status`` shows the state.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from sidecar import signals as S
from sidecar.export.metrics import Metrics
from sidecar.export.server import bearer_authorized
from sidecar.protect.breaker import BreakerSettings, BypassBreaker, Route, Source, State
from sidecar.protect.forward import (
    ForwardApp,
    ForwardLimits,
    ForwardServer,
    Reply,
    Request,
    error,
)
from sidecar.protect.http_messages import normal_path
from sidecar.protect.reception import Heap

log = logging.getLogger(__name__)
ENGINE = "guard"
SALT_PREFIX = "kvsidecar-guard-"
# Per-replica pages, matched on `instance`. Localised is among them: the shipped
# Alertmanager inhibits the other two under it, so a lone faulty replica pages only so.
INSTANCE_PAGES = frozenset({S.ALERT_CONTENT_ANOMALY, S.ALERT_HIGH_HIT_RATE_WITH_ANOMALIES,
                            S.ALERT_ANOMALY_LOCALISED})
FLEET_PAGES = frozenset({S.ALERT_ANOMALY_FLEET_WIDE})
STATUS_MAX_BYTES = 1 << 20
# Generation routes: while bypassing, a body the guard cannot salt here is refused. Every
# other POST under /v1/ is salted too when its body is a JSON object (vLLM reads cache_salt
# on its pooling and Anthropic routes as well), else forwarded and counted unprotected.
# vLLM's /invocations (SageMaker) routes by body to completions or chat, so it is one too.
# Other native routes (SGLang's /generate, which keys its cache on extra_key, not
# cache_salt) are forwarded as sent.
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                               "/v1/messages", "/invocations"})
REPLAYED_ROUTES = ("/v1/completions", "/v1/chat/completions")  # what the verifier replays


@dataclass
class GuardConfig:
    upstream: tuple[str, int]
    listen: tuple[str, int] = ("127.0.0.1", 0)
    model: str = ""
    instance: str = ""  # the alert `instance` label of the sidecar that watches this server
    verify_every: int = 100  # 0: no local verification
    token: str | None = None
    sidecar_status: str | None = None
    sidecar_token: str | None = None
    poll_every_s: float = 5.0
    limits: ForwardLimits = field(default_factory=ForwardLimits)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)


# Parsing a body takes many times its size in objects (an 8 MiB body of ``{}``s: ~200 MB),
# so large ones are parsed one at a time and the heap trimmed after: the body cap then
# bounds the guard's memory, however many such requests arrive at once.
LARGE_BODY_BYTES = 256 << 10
_LARGE_PARSE = threading.Lock()
_HEAP = Heap()


def salted(body: bytes) -> bytes | str:
    """``body`` (a JSON object) with a fresh ``cache_salt``, or why it cannot be salted."""
    if len(body) <= LARGE_BODY_BYTES:
        return _salted(body)
    with _LARGE_PARSE:
        out = _salted(body)
        _HEAP.trim()
    return out


def _salted(body: bytes) -> bytes | str:
    try:
        obj = json.loads(body)
    except RecursionError:
        return "a body nested too deep"
    except ValueError as exc:  # not JSON, or an integer beyond Python's 4,300 digits
        return ("a body with an integer too long to read" if "digits" in str(exc)
                else "a body that is not a JSON object")
    if not isinstance(obj, dict):
        return "a body that is not a JSON object"
    obj["cache_salt"] = SALT_PREFIX + uuid.uuid4().hex
    try:  # a number beyond float range (1e400) is read as inf: not JSON to send on
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return "a body with a number beyond the float range"
    except RecursionError:
        return "a body nested too deep"


def pages_for(payload: Any, instance: str, model: str) -> list[str]:
    """The firing alerts of an Alertmanager webhook payload that concern this guard."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise ValueError("not an Alertmanager webhook payload (no alerts list)")
    out = []
    for alert in payload["alerts"][:1000]:
        # Alertmanager sends every alert as an object with a status and a labels map: any
        # other shape is a malformed payload (400), not an alert to skip quietly.
        if not isinstance(alert, dict) or not isinstance(alert.get("status"), str) \
                or not isinstance(alert.get("labels"), dict):
            raise ValueError("each alert must be an object with a status string and a "
                             "labels object")
        if alert["status"] != "firing":
            continue
        labels = alert["labels"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ValueError("alert labels must map strings to strings")
        name = labels.get("alertname")
        mine = (name in INSTANCE_PAGES and bool(instance)
                and labels.get("instance") == instance)
        fleet = name in FLEET_PAGES and bool(model) and labels.get("model") == model
        if mine or fleet:
            out.append(str(name))
    return out


class GuardApp(ForwardApp):
    """The guard's part of the forwarding: routes, salts, samples, and its own paths."""

    def __init__(self, guard: BypassGuard) -> None:
        self.guard = guard
        self._seen = itertools.count(1)

    def local(self, request: Request) -> Reply | None:
        # The guard's own paths in every spelling a server would route alike (``//guard/``,
        # ``/GUARD/``, ``/x/../guard/``): none of them goes upstream with the guard's token.
        route = normal_path(request.route).lower()
        if route != "/guard" and not route.startswith("/guard/"):
            return self._decide(request)
        g = self.guard
        if g.cfg.token is not None:
            given = [v for k, v in request.headers if k.lower() == "authorization"]
            if not bearer_authorized(given, g.cfg.token):
                return Reply(401, b"unauthorized\n",
                             headers=[("WWW-Authenticate", 'Bearer realm="kv-sidecar"')])
        if route == "/guard/status" and request.method == "GET":
            return Reply(200, json.dumps(g.status()).encode(), "application/json")
        if request.method != "POST":
            return error(404, "unknown guard path")
        force = {"/guard/open": State.OPEN, "/guard/close": State.CLOSED,
                 "/guard/half-open": State.HALF_OPEN}.get(route)
        if force is not None:
            g.breaker.force(force)
            return Reply(200, json.dumps(g.status()).encode(), "application/json")
        if route == "/guard/alertmanager":
            try:
                pages = pages_for(json.loads(request.body), g.cfg.instance, g.model)
            except ValueError as exc:
                return error(400, str(exc))
            except RecursionError:
                return error(400, "payload nested too deep")
            if pages:
                log.warning("guard: page %s: bypassing the cache", ", ".join(pages))
                g.breaker.anomaly(Source.WEBHOOK)
            return Reply(200, json.dumps({"opened": bool(pages), "alerts": pages}).encode(),
                         "application/json")
        return error(404, "unknown guard path")

    def _decide(self, request: Request) -> Reply | None:
        """Route one forwarded request; a Reply refuses it (a body the guard must salt and
        cannot). Decided on the path the server will route, which is the one forwarded;
        matched without case, so no spelling of a salted route passes unsalted."""
        if request.method != "POST":
            return None
        path = normal_path(request.path)
        low = path.lower()
        generation = low in GENERATION_ROUTES
        if not low.startswith("/v1/") and not generation:
            return None
        query = request.path.partition("?")[2]
        request.path = path + ("?" + query if query else "")
        g = self.guard
        route = g.breaker.route()
        if route is not Route.FORWARDED and not g.bypass_supported:
            g.count(Route.UNPROTECTED if route is Route.BYPASSED else route)
            return None
        verify = path in REPLAYED_ROUTES and (route is Route.PROBE or (
            route is Route.FORWARDED and g.cfg.verify_every > 0
            and next(self._seen) % g.cfg.verify_every == 0))
        if verify:
            request.meta["verify"] = True  # replayed once answered
            request.meta["probe"] = route is Route.PROBE
        if route is not Route.BYPASSED:
            g.count(route)
            return None
        encoding = (request.header("Content-Encoding") or "identity").strip().lower()
        body = salted(request.body) if encoding == "identity" else f"Content-Encoding {encoding}"
        if isinstance(body, str):
            if generation:
                g.count(Route.REFUSED)
                return error(415 if encoding != "identity" else 400,
                             f"the cache-bypass guard is open and cannot add a cache_salt "
                             f"to {body}: send an uncompressed JSON object")
            g.count(Route.UNPROTECTED)
            return None
        request.meta["body"] = body
        g.count(Route.BYPASSED)
        return None

    def rewrite(self, request: Request) -> bytes:
        body = request.meta.get("body")
        return body if isinstance(body, bytes) else request.body

    def answered(self, request: Request, forwarded: bytes, status: int) -> None:
        if not request.meta.get("verify"):
            return
        g = self.guard
        verified = status == 200 and g.verifier is not None and \
            g.verifier.submit(request.path, forwarded)
        if not verified and request.meta.get("probe"):
            g.breaker.probe_failed()  # an error answer, or one that cannot be replayed


def status_counts(body: Any) -> tuple[int, int]:
    """(anomalies, verified) from a kv-sidecar's ``/status`` (``sidecar.export.summary``):
    ``anomalies`` is a map kind -> count, summed; ``verified`` a count. Anything else raises
    ValueError or TypeError naming what is wrong."""
    if not isinstance(body, dict):
        raise TypeError("not a kv-sidecar /status: not a JSON object")
    kinds, verified = body["anomalies"], body["verified"]
    if not isinstance(kinds, dict) or not all(
            type(k) is str and type(v) is int and v >= 0 for k, v in kinds.items()):
        raise TypeError("not a kv-sidecar /status: anomalies is not a map of kind -> count")
    if type(verified) is not int or verified < 0:
        raise TypeError("not a kv-sidecar /status: verified is not a count")
    return sum(kinds.values()), verified


class BypassGuard:
    """The guard: breaker, forwarding server, verdict sources and signals."""

    def __init__(self, cfg: GuardConfig, verifier_factory: Any = None,
                 bypass_supported: bool = True, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.model
        self.bypass_supported = bypass_supported
        self.metrics = metrics or Metrics(ENGINE, cfg.model or "unknown")
        self.metrics.register(S.GUARD_SIGNALS)
        self.breaker = BypassBreaker(cfg.breaker, self._transition)
        for st in State:
            self.metrics.gauge(S.GUARD_STATE, state=st.value).set(int(st is State.CLOSED))
        for r in Route:
            self.metrics.inc(S.GUARD_REQUESTS, 0, route=r.value)
        self.metrics.inc(S.GUARD_STATUS_FAILURES, 0)
        self.metrics.gauge(S.GUARD_BYPASS_SUPPORTED).set(int(bypass_supported))
        self.verifier = verifier_factory(self._on_verdict) if verifier_factory else None
        if self.verifier is not None:
            self.verifier.on_error = self.breaker.probe_failed
        self.server = ForwardServer(
            cfg.upstream, cfg.listen, cfg.limits, GuardApp(self), name="kvsidecar-guard",
            on_refused=lambda status: self.metrics.inc(S.PROXY_REFUSED, status=str(status)))
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._status_seen: tuple[int, int] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def count(self, route: Route) -> None:
        self.metrics.inc(S.GUARD_REQUESTS, route=route.value)

    def _transition(self, was: State, to: State, source: Source) -> None:
        self.metrics.gauge(S.GUARD_STATE, state=was.value).set(0)
        self.metrics.gauge(S.GUARD_STATE, state=to.value).set(1)
        self.metrics.inc(S.GUARD_TRANSITIONS, to=to.value, source=source.value)

    def _on_verdict(self, anomalous: bool) -> None:
        if anomalous:
            self.breaker.anomaly(Source.LOCAL)
        else:
            self.breaker.clean(Source.LOCAL)

    def status(self) -> dict[str, Any]:
        m = self.metrics
        return {"state": self.breaker.current().value, "clean_probes": self.breaker.clean_probes,
                "probes_to_close": self.cfg.breaker.probes,
                "probe_errors_to_open": self.cfg.breaker.probe_errors,
                "bypass_supported": self.bypass_supported,
                "requests": {r.value: int(m.value(S.GUARD_REQUESTS.name, route=r.value))
                             for r in Route},
                "transitions": [[a.value, b.value, s.value]
                                for a, b, s in self.breaker.transitions[-16:]],
                "proxy": dict(self.server.stats),
                "upstream_connections": self.server.upstream_stats(),
                "refused": {str(k): v for k, v in self.server.rejected.items()},
                "verifier": dict(self.verifier.stats) if self.verifier else None}

    def start(self) -> BypassGuard:
        if self.verifier is not None:
            self.verifier.start()
        self.server.start()
        if self.cfg.sidecar_status:
            self.poll_status()  # the baseline: what the sidecar counted before the guard
            self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                            name="kvsidecar-guard-status")
            self._poller.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
        if self.verifier is not None:
            self.verifier.stop()
        if self._poller is not None:
            self._poller.join(timeout=10)

    # ------------------------------------------------------------- a sidecar's /status
    def poll_status(self) -> None:
        """One read of the sidecar's /status: new anomalies open, new clean verdicts count."""
        url = self.cfg.sidecar_status
        assert url, "poll_status needs sidecar_status"
        headers = {"Authorization": f"Bearer {self.cfg.sidecar_token}"} \
            if self.cfg.sidecar_token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=min(self.cfg.poll_every_s, 10.0)) as r:
                raw = r.read(STATUS_MAX_BYTES + 1)
            if len(raw) > STATUS_MAX_BYTES:
                raise ValueError("answer too large")
            seen = status_counts(json.loads(raw))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            self.metrics.inc(S.GUARD_STATUS_FAILURES)
            log.warning("guard: cannot read %s: %s", url, exc)
            return
        last, self._status_seen = self._status_seen, seen
        if last is None:
            return
        new_anomalies, new_verified = seen[0] - last[0], seen[1] - last[1]
        if new_anomalies > 0:
            self.breaker.anomaly(Source.SIDECAR)
        elif new_verified > 0:
            self.breaker.clean(Source.SIDECAR, new_verified)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.cfg.poll_every_s):
            self.poll_status()
