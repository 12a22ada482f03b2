"""The event-stream audit against vLLM's own publisher: a tampered event is exactly one
hash mismatch, a dropped batch is recovered through vLLM's replay socket, and the hash
recipe agrees with vLLM's functions for every algorithm and kind of extra key."""

from __future__ import annotations

import copy
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.subscriber import EventSubscriber
from sidecar.export.metrics import Metrics
from tests.vllm.harness import Engine, Workload, generate, start_engine, stop_engine

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


class Proxy:
    """Forwards vLLM's KV event stream to a second endpoint, tampering with the first live
    BlockStored (``mode="tamper"``) or dropping the second live batch (``mode="drop"``)."""

    def __init__(self, source: str, sink: str, mode: str) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = ctx.socket(zmq.XPUB)  # XPUB: we can tell when the subscriber has joined
        self.pub.bind(sink)
        self.mode = mode
        self.forwarded = 0
        self.touched = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Forward nothing before the subscriber's subscription arrives (vLLM's batches wait
        # in our SUB queue meanwhile), so no batch is lost to the slow-joiner effect.
        while not self._stop.is_set() and not self.pub.poll(50):
            pass
        if not self._stop.is_set():
            self.pub.recv()
        while not self._stop.is_set():
            if not self.sub.poll(50):
                continue
            frames = self.sub.recv_multipart()
            if not self.touched and self.mode == "drop" and self.forwarded == 1:
                self.touched = True
                self.forwarded += 1
                continue
            if not self.touched and self.mode == "tamper":
                frames = self._tamper(frames)
            self.pub.send_multipart(frames)
            self.forwarded += 1

    def _tamper(self, frames: list[bytes]) -> list[bytes]:
        batch = msgpack.unpackb(frames[2], raw=False)
        for i, ev in enumerate(batch[1]):
            if ev.get("type") == "BlockStored":
                ev = copy.deepcopy(ev)
                ev["token_ids"][-1] ^= 1  # the last block: no child in this event
                batch[1][i] = ev
                self.touched = True
                return [frames[0], frames[1], msgpack.packb(batch, use_bin_type=True)]
        return frames

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sub.close(0)
        self.pub.close(0)


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Engine]:
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    eng = start_engine(tiny_model, "float32", d)
    try:
        generate(eng.llm, Workload(seed=5).round())  # history the late subscriber replays
        yield eng
    finally:
        stop_engine(eng)
        del eng
        gc.collect()
        shutil.rmtree(d, ignore_errors=True)


def _proxied(eng: Engine, mode: str) -> tuple[Proxy, EventAuditor, EventSubscriber]:
    cfg = eng.sidecar.cfg
    sink = cfg.events_endpoint.replace("ev.sock", f"{mode}.sock")  # type: ignore[union-attr]
    proxy = Proxy(cfg.events_endpoint or "", sink, mode)
    auditor = EventAuditor(Metrics("vllm", "proxied"), cfg.hash_algo, cfg.hash_seed)
    sub = EventSubscriber(auditor, sink, cfg.replay_endpoint).start()
    time.sleep(0.5)  # both subscriptions reach their publishers before traffic starts
    return proxy, auditor, sub


def _settle(eng: Engine, sub: EventSubscriber) -> None:
    main = eng.sidecar.subscriber
    assert main is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if main.expected is not None and sub.expected == main.expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"proxied stream at {sub.expected}, engine's at {main.expected}")


def test_tampered_event_is_exactly_one_hash_mismatch(engine: Engine) -> None:
    proxy, auditor, sub = _proxied(engine, "tamper")
    try:
        for prompt in Workload(seed=11).round():  # one request per step: several batches
            generate(engine.llm, [prompt])
        _settle(engine, sub)
    finally:
        sub.stop()
        proxy.close()
    assert proxy.touched
    s = auditor.summary()
    assert s["hash_mismatches"] == 1 and s["decode_errors"] == 0
    assert s["hashes_verified"] == s["events_stored"] - 1
    clean = engine.sidecar.auditor.summary()  # the engine's own stream, untouched
    assert clean["hash_mismatches"] == 0 and clean["decode_errors"] == 0


def test_dropped_batch_is_recovered_through_vllms_replay_socket(engine: Engine) -> None:
    proxy, auditor, sub = _proxied(engine, "drop")
    try:
        for prompt in Workload(seed=12).round():
            generate(engine.llm, [prompt])
        _settle(engine, sub)
    finally:
        sub.stop()
        proxy.close()
    assert proxy.touched
    s = auditor.summary()
    assert s["gaps"] == 1 and s["batches_lost"] == 0 and s["batches_replayed"] >= 2
    assert s["hash_mismatches"] == s["unknown_removals"] == s["decode_errors"] == 0
    assert auditor.indexed(0, "GPU") == engine.sidecar.auditor.indexed(0, "GPU")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("seed", [None, "4321"])
def test_hash_recipe_matches_vllms_own_functions(algo: str, seed: str | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm  # noqa: F401  (kv_cache_utils needs vllm initialised first)
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from sidecar.adapters.vllm import hashing

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    vfn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(vfn)
    mine = hashing.none_hash(algo, seed)
    if mine is None:  # xxhash without a seed: vLLM draws a random one we cannot know
        assert algo.startswith("xxhash") and seed is None
        return
    assert mine == kcu.NONE_HASH
    fn = hashing.hash_function(algo)
    tagged: Any = (("lora", "ad", "/adapters/ad"), ("mm", "img-1", 4),
                   ("cache_salt", "tenant"), ("prompt_embeds", b"\x00" * 32))
    (event_keys,) = kcu.to_event_extra_keys([tagged]) or [None]
    assert hashing.event_extra_keys_to_hash_keys(event_keys, "ad", {"ad": "/adapters/ad"}) \
        == tagged
    parent = None
    for keys in (tagged, None, (("mm", "img-1", 0),)):
        tokens = list(range(7, 39))
        want = kcu.hash_block_tokens(vfn, parent, tokens, keys)
        got = hashing.hash_block(fn, parent or mine, tokens, keys)
        assert got == want
        assert hashing.external(got, True) == kcu.maybe_convert_block_hash(want)
        parent = want


def test_probe_refuses_an_untested_vllm_version(tiny_model: str, tmp_path: Path) -> None:
    code = (
        "import vllm; vllm.__version__ = '0.31.9'\n"
        "from vllm import LLM\n"
        "from sidecar.adapters.vllm.engine_config import llm_kwargs\n"
        f"LLM(model={tiny_model!r}, block_size=32, enforce_eager=True, max_model_len=256,\n"
        f"    skip_tokenizer_init=True, **llm_kwargs('ipc://{tmp_path}/p.sock', None))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode != 0
    assert "supports vLLM 0.32.0 to 0.33.0" in proc.stderr and "found 0.31.9" in proc.stderr
