import random
import threading
import time

import pytest

from sidecar.core.admission import TokenBucket
from sidecar.core.protocol import Hit
from sidecar.core.sampling import UniformSampler, choose_blocks
from sidecar.core.time_limits import AdapterRefused, AdapterTimeout, Guard


def test_guard_returns_results_and_reraises_errors():
    g = Guard(1.0)
    assert g.call("op", lambda x: x + 1, 1) == 2
    with pytest.raises(KeyError):
        g.call("op", lambda: {}["missing"])


def test_guard_times_out_and_refuses_when_too_many_are_stuck():
    release = threading.Event()
    g = Guard(0.05, max_stuck=2)
    for _ in range(2):
        with pytest.raises(AdapterTimeout):
            g.call("read", release.wait)
    assert g.stuck == 2
    with pytest.raises(AdapterRefused):
        g.call("read", lambda: 1)
    release.set()
    deadline = time.monotonic() + 60  # bounds a hang only
    while g.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.stuck == 0
    assert g.call("read", lambda: 3) == 3


def test_choose_blocks_always_includes_the_last_full_block():
    hit = Hit(list(range(70)), 64, {0: list(range(100, 116))})
    rng = random.Random(0)
    for _ in range(50):
        refs = choose_blocks(hit, 4, 3, rng)
        assert refs[-1].index == 15 and refs[-1].block_id == 115
        assert len(refs) == 3 and len({r.index for r in refs}) == 3


def test_uniform_sampler_rejects_bad_rate():
    with pytest.raises(ValueError, match="sample-every"):
        UniformSampler(0)


def test_token_bucket_limits_recompute_rate():
    bucket = TokenBucket(rate=100, burst=100)
    assert bucket.take(100)
    assert not bucket.take(50)
    assert TokenBucket(rate=0).take(10**9)  # 0 = unlimited
