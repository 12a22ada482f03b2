"""The canary loop: paired probes, comparison, audit, export, at a rate-limited pace."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient, RequestFailed
from sidecar.canary.compare import Tolerance, divergence
from sidecar.canary.endpoint import CanaryError
from sidecar.canary.exporter import CanaryExporter
from sidecar.canary.hit_audit import MetricsAudit, audit_pair, counter_sum, proven_hit_tokens
from sidecar.canary.load import RateLimit
from sidecar.canary.probes import MODES, PromptFactory, boundary_lengths, run_pair
from sidecar.signals import AuditKind

log = logging.getLogger(__name__)


@dataclass
class CanaryConfig:
    dtype: str = "bfloat16"
    block_size: int = 16
    mode: str = "auto"
    pairs: int = 0  # 0: run until stopped
    max_tokens: int = 4
    logprobs: int = 5
    token_low: int = 3
    token_high: int = 500
    seed: int | None = None  # None: fresh prompts on every run (see PromptFactory)
    calibration: int = 8
    rate: RateLimit = field(default_factory=RateLimit)
    metrics_every: int = 4  # pairs between reads of the server's /metrics


@dataclass
class Report:
    """What one run found; ``as_dict`` is the CLI's JSON."""

    mode: str = ""
    model: str = ""
    dtype: str = ""
    pairs: int = 0
    requests: int = 0
    anomalies: int = 0
    max_divergence: float = 0.0
    divergences: list[float] = field(default_factory=list)
    audit: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    last_error: str = ""  # the message of the latest failed probe (why, for exit code 2)
    tolerance: float = 0.0
    noise_floor: float = 0.0
    calibrated: bool = False
    server_rate: float | None = None
    allowed_rate: float = 0.0
    replay: dict[str, float] = field(default_factory=dict)  # the replay proxy's counts

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["divergences"] = [float(f"{d:.3g}") for d in self.divergences[-64:]]
        return out


class Canary:
    def __init__(self, client: OpenAIClient, cfg: CanaryConfig,
                 exporter: CanaryExporter | None = None) -> None:
        self.client = client
        self.cfg = cfg
        self.model = client.resolve_model()
        self.exporter = exporter or CanaryExporter(self.model)
        self.tolerance = Tolerance(cfg.dtype, cfg.calibration)
        self.prompts = PromptFactory(cfg.token_low, cfg.token_high, cfg.seed)
        self.lengths = boundary_lengths(cfg.block_size)
        self.metrics_audit = MetricsAudit()
        self.report = Report(model=self.model, dtype=cfg.dtype)
        self.mode = cfg.mode

    # ------------------------------------------------------------------ start-up checks
    def preflight(self) -> None:
        """One request that must come back with logprobs, then the pairing mode. Raises
        :class:`CanaryError` (exit code 2) for an unusable server."""
        probe = self.prompts.prompt(self.cfg.block_size + 1)
        self.client.complete(probe, 1, self.cfg.logprobs)
        if self.mode == "auto":
            self.mode = "salt" if self._salt_isolates(probe) else "pair"
        self.tolerance.trusted = self.mode == "salt"
        self.report.mode = self.mode
        self.exporter.metrics.gauge(S.CANARY_TOLERANCE).set(self.tolerance.value)

    def _salt_isolates(self, warm: list[int]) -> bool:
        """A server that honours ``cache_salt`` reports no cached tokens for a salted
        repeat of a prompt it just cached; one that ignores the field reports a hit."""
        try:
            again = self.client.complete(warm, 1, self.cfg.logprobs,
                                         salt=f"kvsidecar-canary-{uuid.uuid4().hex}")
        except RequestFailed as exc:
            log.info("canary: cache_salt refused (%s); using plain pairs", exc)
            return False
        return again.cached_tokens == 0

    # ------------------------------------------------------------------ one pair
    def probe_once(self) -> None:
        cfg = self.cfg
        prompt = self.prompts.prompt(self.lengths[self.report.pairs % len(self.lengths)])
        started = time.perf_counter()
        try:
            pair = run_pair(self.client, prompt, self.mode, cfg.max_tokens, cfg.logprobs)
        except RequestFailed as exc:
            self.exporter.error(exc.reason)
            self.report.errors[exc.reason] = self.report.errors.get(exc.reason, 0) + 1
            self.report.last_error = f"{exc.reason}: {exc}"
            log.warning("canary: probe failed: %s", exc)
            self.report.pairs += 1
            return
        self.report.pairs += 1
        self.report.requests += pair.requests
        cfg.rate.sent(pair.requests)
        self.exporter.request("miss", pair.first)
        self.exporter.request("hit", pair.hit)
        if pair.reference is not None:
            self.exporter.request("reference", pair.reference)
            self.tolerance.learn(divergence(pair.first, pair.reference).value)
        d = divergence(pair.baseline, pair.hit).value
        if pair.reference is None:
            self.tolerance.learn(d)
        tol = self.tolerance.value
        anomalous = d > tol
        self.exporter.verdict(d, tol, anomalous, time.perf_counter() - started)
        if anomalous:
            self.report.anomalies += 1
            log.warning("canary: %d-token prompt: cached answer diverges by %.3g "
                        "(tolerance %.3g)", pair.prompt_len, d, tol)
        audit = audit_pair(pair, cfg.block_size)
        self.exporter.audit(audit)
        for kind in audit.mismatches:
            self.report.audit[kind.value] = self.report.audit.get(kind.value, 0) + 1
        self.metrics_audit.add_proven(proven_hit_tokens(audit))
        self.report.divergences.append(d)
        self.report.max_divergence = max(self.report.max_divergence, d)

    def read_server_metrics(self) -> None:
        text = self.client.metrics_text()
        self.cfg.rate.observe_server(text)
        if self.metrics_audit.tick(counter_sum(text) if text else None):
            kind = AuditKind.METRICS_UNDER_REPORTED
            self.exporter.audit(None, [kind])
            self.report.audit[kind.value] = self.report.audit.get(kind.value, 0) + 1

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event | None = None) -> Report:
        stop = stop or threading.Event()
        self.read_server_metrics()
        while not stop.is_set() and (self.cfg.pairs == 0 or self.report.pairs < self.cfg.pairs):
            self.probe_once()
            if self.report.pairs % self.cfg.metrics_every == 0:
                self.read_server_metrics()
            stop.wait(self.cfg.rate.pause_for(3 if self.mode == "salt" else 2))
        time.sleep(0.2)  # the server's counters trail its answers slightly
        self.read_server_metrics()
        self.read_server_metrics()  # the last pairs are compared one tick late
        r = self.report
        r.tolerance, r.noise_floor = self.tolerance.value, self.tolerance.noise_floor
        r.calibrated = self.tolerance.calibrated
        r.server_rate, r.allowed_rate = self.cfg.rate.server_rate, self.cfg.rate.allowed_rate
        return r


def make_canary(client: OpenAIClient, cfg: CanaryConfig) -> Canary:
    if cfg.mode not in MODES:
        raise CanaryError(f"unknown mode {cfg.mode!r}; known: {', '.join(MODES)}")
    canary = Canary(client, cfg)
    canary.preflight()
    return canary
