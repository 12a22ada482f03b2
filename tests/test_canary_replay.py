"""The canary's replay proxy against the fake server: it forwards bytes unchanged, replays
one request in N, catches a corrupted cache, is refused where the cache salt is ignored; a
restarted canary sends fresh prompts."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.canary.client import OpenAIClient
from sidecar.canary.endpoint import parse_endpoint
from sidecar.canary.replay import ReplayProxy
from sidecar.canary.runner import CanaryConfig, make_canary
from tests.canary_fake import BLOCK, FakeServer, _fast


# ---------------------------------------------------------------- replay proxy
@pytest.fixture
def proxied() -> Iterator[tuple[FakeServer, ReplayProxy]]:
    with FakeServer() as fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(dtype="float32", block_size=BLOCK))
        proxy = ReplayProxy(client, canary.exporter, canary.tolerance, every=2).start()
        try:
            yield fake, proxy
        finally:
            proxy.stop()


def test_replay_proxy_forwards_unchanged_and_replays_one_in_n(
        proxied: tuple[FakeServer, ReplayProxy]) -> None:
    fake, proxy = proxied
    for i in range(4):
        body = json.dumps({"model": "fake", "prompt": list(range(i, i + 9)),
                           "max_tokens": 2, "logprobs": 1}).encode()
        req = urllib.request.Request(proxy.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        via = urllib.request.urlopen(req, timeout=10).read()
        assert json.loads(via)["usage"]["prompt_tokens"] == 9
    models = urllib.request.urlopen(proxy.url + "/v1/models", timeout=10).read()
    assert models == b'{"data": [{"id": "fake"}]}'
    proxy.drain()
    assert proxy.stats["forwarded"] == 5 and proxy.stats["replayed"] == 2
    assert proxy.stats["anomalies"] == 0
    replays = [b for b in fake.bodies if b.get("cache_salt", "").startswith("kvsidecar-replay")]
    assert len(replays) == 2 and all(b["temperature"] == 0.0 for b in replays)


def test_replay_proxy_replays_chat_and_catches_a_corrupted_cache(
        proxied: tuple[FakeServer, ReplayProxy]) -> None:
    fake, proxy = proxied

    def chat(text: str) -> dict[str, Any]:
        body = json.dumps({"model": "fake", "max_tokens": 2, "temperature": 0.7,
                           "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": text}]}).encode()
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())

    for text in ("hello there", "general kenobi"):
        assert chat(text)["choices"][0]["message"]["role"] == "assistant"
    proxy.drain()
    assert proxy.stats["replayed"] == 1 and proxy.stats["anomalies"] == 0
    fake.corrupt = True
    for text in ("what is a kv cache", "and a prefix hit"):
        chat(text)
    proxy.drain()
    assert proxy.stats["replayed"] == 2 and proxy.stats["anomalies"] == 1
    replays = [b for b in fake.bodies if b.get("cache_salt", "").startswith("kvsidecar-replay")]
    assert all(b["temperature"] == 0.0 and b["top_logprobs"] == 5 for b in replays)


def test_replay_proxy_refused_where_cache_salt_is_ignored() -> None:
    with FakeServer(salt=False) as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "1", "--replay-port", "0")
    assert rc == 2 and "cache_salt" in out, out


def test_a_restarted_canary_sends_fresh_prompts() -> None:
    with FakeServer() as fake:
        runs = [json.loads(_fast(fake.endpoint, "--pairs", "3", "--json")[1])
                for _ in range(2)]
        seeded = [json.loads(_fast(fake.endpoint, "--pairs", "3", "--json", "--seed", "5")[1])
                  for _ in range(2)]
    assert runs[0]["audit"] == runs[1]["audit"] == {} == seeded[0]["audit"]
    # The same seed on a server that cached the first run: its "misses" are real hits.
    assert seeded[1]["audit"].get("phantom_hit", 0) >= 1
