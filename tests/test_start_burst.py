"""The start burst (higher-rate sampling after start, restart and upgrade, then 1 in N), the
expected time to first detection, and the verified share of distinct cached blocks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.sequence import Request
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.adapters.vllm.service import VllmSidecar, hello_build
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import Hit
from sidecar.core.sampling import AdaptiveSampler, Burst, UniformSampler
from sidecar.core.store_index import StoreIndex
from sidecar.export.metrics import Metrics
from sidecar.export.outlook import DetectionOutlook
from tests.limits import DETECTION_TIMEOUT_S

HIT = Hit(tokens=[1] * 40, hit_tokens=32, blocks={0: [1, 2]})


def _samples(sampler: object, n: int) -> int:
    return sum(bool(sampler.should_sample(HIT)) for _ in range(n))  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [
    lambda b: UniformSampler(1000, seed=3, burst=b),
    lambda b: AdaptiveSampler(1000, seed=3, burst=b),
])
def test_burst_samples_1_in_k_then_decays_to_1_in_n_and_rearms(make: object) -> None:
    sampler = make(Burst(hits=200, every=4))  # type: ignore[operator]
    assert sampler.current_every == 4
    assert _samples(sampler, 200) == 50  # the burst: 1 in 4
    assert sampler.current_every == 1000
    assert _samples(sampler, 5000) in (4, 5, 6)  # then 1 in 1,000 (a phase either way)
    sampler.rearm("upgrade")
    assert sampler.burst.reason == "upgrade" and sampler.burst.armed == 2
    assert sampler.should_sample(HIT)  # the next hit after a rearm is sampled
    assert _samples(sampler, 199) == 49
    assert sampler.current_every == 1000


def test_no_burst_and_a_burst_never_samples_less_than_the_policy() -> None:
    plain = UniformSampler(7, seed=0)
    assert _samples(plain, 700) == 100 and plain.burst.armed == 0
    plain.rearm("restart")  # no burst configured: nothing changes
    assert plain.current_every == 7
    slow = UniformSampler(2, seed=0, burst=Burst(hits=100, every=10))
    assert _samples(slow, 100) == 50  # burst every 10 > 1 in 2: the policy's rate holds
    with pytest.raises(ValueError, match="burst"):
        Burst(hits=-1)


def test_monitor_starts_in_a_burst_and_exports_rate_and_expected_detection() -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=64))
    mon = Monitor(ReferenceAdapter(engine), SidecarConfig(
        sample_every=100, burst_hits=20, burst_every=2, dispatch="inline",
        allocator_every_s=0.0, detection_fault_fraction=0.05,
        adapter_timeout_s=DETECTION_TIMEOUT_S))
    engine.sink = mon
    m = mon.metrics
    assert m.value(S.SAMPLE_EVERY_CURRENT.name) == 2
    assert m.value(S.SAMPLE_BURSTS.name, reason="start") == 1
    assert m.value(S.EXPECTED_DETECTION_HITS.name) == pytest.approx(2 / 0.05)
    assert m.value(S.EXPECTED_DETECTION_SECONDS.name) == math.inf  # no hits yet
    prompt = list(range(1, 3 * engine.block_size + 2))
    for _ in range(30):
        engine.serve(Request(list(prompt), max_new_tokens=1))
    s = mon.summary()
    assert s["sample_every_now"] == 100 and s["burst_hits_left"] == 0
    assert s["expected_detection_hits"] == pytest.approx(100 / 0.05)
    assert s["expected_detection_seconds"] is not None and s["expected_detection_seconds"] > 0
    assert m.value(S.SAMPLE_EVERY_CURRENT.name) == 100
    mon.outlook.rearm(S.BurstReason.UPGRADE)
    assert m.value(S.SAMPLE_BURSTS.name, reason="upgrade") == 1
    assert m.value(S.SAMPLE_EVERY_CURRENT.name) == 2


def test_expected_detection_is_n_over_f_hits_and_n_over_f_times_rate_seconds() -> None:
    t = [0.0]
    hits = [0.0]
    metrics = Metrics("e", "m", CollectorRegistry())
    out = DetectionOutlook(metrics, StoreIndex(16), UniformSampler(1000), lambda: hits[0],
                           fault_fraction=0.01, clock=lambda: t[0])
    t[0], hits[0] = 10.0, 500.0  # 50 hits per second
    assert out.expected() == (pytest.approx(1e5), pytest.approx(1e5 / 50))
    out.refresh(force=True)
    assert metrics.value(S.EXPECTED_DETECTION_SECONDS.name) == pytest.approx(2000.0)


def test_verified_share_counts_distinct_blocks_verified_since_written() -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=128))
    mon = Monitor(ReferenceAdapter(engine), SidecarConfig(
        sample_every=1, blocks_per_sample=64, burst_hits=0, dispatch="inline",
        allocator_every_s=0.0, adapter_timeout_s=DETECTION_TIMEOUT_S))
    engine.sink = mon
    bs = engine.block_size
    a = [3] * (4 * bs + 1)
    b = [5] * (4 * bs + 1)
    for prompt in (a, b):
        engine.serve(Request(list(prompt), max_new_tokens=1))
    assert mon.outlook.verified_share() == 0.0  # stored, never hit
    engine.serve(Request(list(a), max_new_tokens=1))
    one = mon.outlook.verified_share()
    engine.serve(Request(list(b), max_new_tokens=1))
    both = mon.outlook.verified_share()
    assert 0 < one < both <= 1.0
    assert mon.summary()["verified_block_share"] == pytest.approx(both, abs=1e-4)
    assert mon.metrics.value(S.VERIFIED_BLOCK_SHARE.name) == pytest.approx(both)


def test_a_new_probe_hello_rearms_the_burst_as_restart_or_upgrade() -> None:
    hello = {"vllm": "0.32.0", "kv_layout": ["torch.bfloat16", [2, 32, 128], [1, 2, 3]],
             "block_size": 32, "kv_heads": 2, "head_dim": 64, "groups": {0: [0, 1]}}
    reasons: list[S.BurstReason] = []
    fake = SimpleNamespace(_last_build=None, info=SimpleNamespace(
        block_size=32, dtype="bfloat16", num_kv_heads=2, head_dim=64, groups=()),
        monitor=SimpleNamespace(outlook=SimpleNamespace(rearm=reasons.append)))
    VllmSidecar._on_hello(fake, hello)  # type: ignore[arg-type]
    VllmSidecar._on_hello(fake, dict(hello))  # type: ignore[arg-type]
    VllmSidecar._on_hello(fake, {**hello, "kv_layout": ["torch.bfloat16", [32, 2, 128],
                                                        [1, 2, 3]]})  # type: ignore[arg-type]
    VllmSidecar._on_hello(fake, {**hello, "vllm": "0.33.0"})  # type: ignore[arg-type]
    assert reasons == [S.BurstReason.RESTART, S.BurstReason.UPGRADE, S.BurstReason.UPGRADE]
    assert hello_build(hello) != hello_build({**hello, "head_dim": 128})
