"""A second, non-paged cache shape under a real Monitor: the radix engine over a token-slot
pool (tests/radix_engine.py) and its protocol-only adapter (tests/radix_adapter.py).

The engine is checked on its own first (its cached KV is real, lock refs hold off eviction),
then the sidecar on it: a clean run under eviction pressure is quiet over >= 2,000 verified
blocks, and each fault is caught with its own kind.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch

from sidecar import signals as S
from sidecar.allocator.invariants import check_snapshot
from sidecar.core.monitor import Monitor
from sidecar.core.protocol import BlockRef, Lookup, StoredBlock
from sidecar.signals import AnomalyKind, DropReason, InvariantKind
from tests.radix_adapter import RadixAdapter
from tests.radix_engine import RadixEngine, Request
from tests.radix_faults import KeyMissingField, PrematureFree, RadixFault, ZeroRun
from tests.radix_workload import ChatConfig, chat, monitored

ADAPTER_FILE = Path(__file__).with_name("radix_adapter.py")


def _greedy(engine: RadixEngine, request: Request) -> list[int]:
    """What the model generates for the request with no cache at all."""
    out = engine.model.forward(request.tokens, request.adapter)
    tokens, kv = [out.next_token], out.kv
    while len(tokens) < request.max_new_tokens:
        step = engine.model.decode_step(tokens[-1], request.adapter, kv)
        kv = type(kv)(torch.cat([kv.keys, step.kv.keys], 2),
                      torch.cat([kv.values, step.kv.values], 2))
        tokens.append(step.next_token)
    return tokens


def _anomalies(mon: Monitor) -> dict[str, float]:
    return mon.metrics.by_label(S.ANOMALIES.name, "kind")


def _violations(mon: Monitor) -> dict[str, float]:
    return {k: v for k, v in mon.metrics.by_label(S.INVARIANT_VIOLATIONS.name, "kind").items()
            if v}


# ---------------------------------------------------------------- the engine itself
def test_hits_are_served_from_the_slots_and_corrupt_slots_change_outputs() -> None:
    engine = RadixEngine(num_slots=2048)
    prompt = list(range(1, 70))
    turns = []
    for extra in (list(range(100, 117)), list(range(140, 145)), list(range(30, 60))):
        prompt = prompt + extra
        request = Request(list(prompt), max_new_tokens=3, adapter="support")
        out = engine.serve([request])[0]
        assert out == _greedy(engine, request)
        turns.append(request)
        prompt = prompt + (out or [])
    # Each turn matched the previous turn's tokens (KV read back from slots, not recomputed).
    assert len(engine.tree_slots()) >= len(turns[-1].tokens)
    engine.pool_k.zero_()
    engine.pool_v.zero_()
    again = Request(turns[-1].tokens + [7, 8], max_new_tokens=3, adapter="support")
    assert engine.serve([again])[0] != _greedy(engine, again)


def test_a_locked_prefix_is_never_evicted_and_unlocked_leaves_go_lru() -> None:
    engine = RadixEngine(num_slots=300)
    first = Request(list(range(200)), max_new_tokens=2)
    assert engine.serve([first])[0] is not None  # 201 slots now owned by the tree
    running = engine._admit(Request(first.tokens + [9] * 10, max_new_tokens=2))  # locks it
    other = Request([5] * 150, max_new_tokens=2)
    assert engine.serve([other]) == [None]  # only the locked path could make room
    # The unlocked one-token leaf after the match went; the locked 200 stayed.
    assert engine.allocation_failures == 1 and engine.evicted_nodes <= 1
    owned = {s for _, s, _ in engine.tree_slots()}
    assert len(running.matched) == 200 and set(running.matched) <= owned
    assert check_snapshot(RadixAdapter(engine).block_tables()[0]) == []
    engine._finish(running)  # unlocked: now the least recently used leaves may go
    assert engine.serve([other])[0] == _greedy(engine, other)
    assert engine.evicted_nodes > 0
    assert check_snapshot(RadixAdapter(engine).block_tables()[0]) == []


# ---------------------------------------------------------------- the adapter
def _code_lines(path: Path) -> int:
    """Lines holding code: no blank lines, comments or docstrings."""
    source = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc_lines.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc_lines)


def test_the_adapter_is_small_and_uses_the_public_protocol_only() -> None:
    assert _code_lines(ADAPTER_FILE) < 100
    tree = ast.parse(ADAPTER_FILE.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    sidecar_modules = {m for m in imported if m.startswith("sidecar")}
    # The protocol, the prefix digest its StoredBlock docstring names, and the slot-engine
    # block names it documents (issue 20).
    assert sidecar_modules == {"sidecar.core.protocol", "sidecar.checks.keys",
                               "sidecar.adapters.slot_blocks", "sidecar.adapters.hook_guard"}


class _Recorder:
    """An EventSink that keeps what the adapter sends."""

    def __init__(self) -> None:
        self.lookups: list[Lookup] = []
        self.stores: list[StoredBlock] = []
        self.freed: list[int] = []

    def on_lookup(self, lookup: Lookup) -> None:
        self.lookups.append(lookup)

    def on_store(self, block: StoredBlock) -> None:
        self.stores.append(block)

    def on_free(self, group_id: int, block_ids) -> None:
        self.freed.extend(block_ids)

    def on_request_done(self, latency_seconds: float) -> None:
        pass


def test_blocks_are_named_by_their_last_slot_without_generation_stamps() -> None:
    engine = RadixEngine(num_slots=700)
    sink = _Recorder()
    adapter = RadixAdapter(engine).attach(sink)
    chat(engine, ChatConfig(conversations=6, turns=3, in_flight=3))
    hits = [lk.hit for lk in sink.lookups if lk.hit is not None and lk.hit.hit_tokens]
    assert hits and all(h.generations == {} for h in hits)
    assert sink.stores and all(b.generation == 0 and b.parent_block_id is None
                               and b.prefix_digest is not None for b in sink.stores
                               if b.prefix_tokens)
    assert sink.freed, "the pool is small enough to evict"
    # A block id is the slot of the block's last token: unique among cached blocks even
    # where paths part inside a block (the first slot is then shared).
    owned = {s for _, s, _ in engine.tree_slots()}
    live = {b.block_id for b in sink.stores if b.block_id in owned}
    for block_id in live:
        run = adapter.runs[block_id]
        assert run[-1] == block_id and len(run) == engine.block_size
    for h in hits:
        refs = [BlockRef(0, i, b) for i, b in enumerate(h.blocks[0])]
        for kv in adapter.read(h, refs):
            assert kv.generation is None and kv.key.shape == (2, 2, 16, 16)


# ---------------------------------------------------------------- the sidecar on it
def test_clean_run_under_eviction_pressure_is_quiet_over_2000_blocks() -> None:
    """Every hit sampled, up to 16 blocks each, captured at match time, reads delayed 5 ms
    on a verifier thread racing the engine, a pool a third of the working set (nodes are
    evicted all the time). Zero anomalies, zero allocator invariant violations (checked
    after every batch)."""
    engine, _, mon = monitored(num_slots=1536, delay_s=0.005)
    chat(engine, ChatConfig(conversations=40, turns=6), poll=mon)
    assert mon.drain(timeout_s=300)
    mon.stop()
    m = mon.metrics
    verified = m.value_sum(S.VERIFIED.name)
    assert _anomalies(mon) == {}
    assert _violations(mon) == {}
    assert verified >= 2000, verified
    assert engine.evicted_nodes > 50 and engine.allocation_failures == 0
    assert m.value_sum(S.HOOK_ERRORS.name) == 0 and m.value_sum(S.ADAPTER_ERRORS.name) == 0


@pytest.mark.parametrize(("capture", "reason"), [
    (False, DropReason.EVICTED_BEFORE_READ), (True, DropReason.REUSED_AFTER_SERVING)])
def test_blocks_evicted_before_the_read_are_dropped_not_flagged(capture, reason) -> None:
    """The slowest verifier: it starts only after the whole workload, so every block
    evicted (or evicted and stored again) since its match is read late. The Monitor's own
    epochs drop those reads (the engine has no stamps); what is still cached is verified."""
    engine, _, mon = monitored(num_slots=1024, capture=capture, start=False)
    chat(engine, ChatConfig(conversations=12, turns=4, seed=2), poll=mon)
    mon.start()
    assert mon.drain(timeout_s=300)
    mon.stop()
    assert _anomalies(mon) == {} and _violations(mon) == {}
    m = mon.metrics
    dropped = m.by_label(S.SAMPLES_DROPPED.name, "reason")
    assert dropped.get(reason.value, 0) > 0, dropped
    assert set(dropped) == {reason.value}, dropped
    assert m.value_sum(S.VERIFIED.name) > 100


def _faulty(fault: RadixFault) -> Monitor:
    engine, _, mon = monitored(num_slots=1536, fault=fault)
    chat(engine, ChatConfig(conversations=16, turns=4, seed=1), poll=mon)
    assert mon.drain(timeout_s=300)
    mon.stop()
    return mon


def test_a_zeroed_slot_run_is_caught_as_zeros() -> None:
    fault = ZeroRun()
    mon = _faulty(fault)
    assert fault.zeroed > 0
    kinds = _anomalies(mon)
    assert kinds.get(AnomalyKind.ZEROS.value, 0) > 0, kinds
    assert set(kinds) <= {AnomalyKind.ZEROS.value, AnomalyKind.RECOMPUTE_MISMATCH.value}
    assert _violations(mon) == {}  # the allocator did nothing wrong


def test_a_slot_run_freed_while_the_tree_names_it_is_caught() -> None:
    """The tree keeps pointing at slots that went back on the free list and were handed to
    another request: hits on the old node serve that request's KV."""
    fault = PrematureFree()
    mon = _faulty(fault)
    assert fault.freed > 0
    kinds = _anomalies(mon)
    assert kinds.get(AnomalyKind.RECOMPUTE_MISMATCH.value, 0) > 0, kinds
    violations = _violations(mon)
    # Freed while indexed, then reused: the slot's content no longer matches its node.
    assert violations.get(InvariantKind.FREE_WHILE_INDEXED.value, 0) > 0, violations
    assert violations.get(InvariantKind.STALE_INDEX.value, 0) > 0, violations


def test_a_key_without_the_adapter_is_caught_as_key_fields_mismatch() -> None:
    mon = _faulty(KeyMissingField())
    kinds = _anomalies(mon)
    assert kinds.get(AnomalyKind.KEY_FIELDS_MISMATCH.value, 0) > 0, kinds
    assert _violations(mon) == {}


def test_allocator_counts_add_up() -> None:
    engine, adapter, mon = monitored(num_slots=800)
    chat(engine, ChatConfig(conversations=4, turns=2), poll=mon)
    mon.stop()
    state = adapter.allocator()
    assert state.free_blocks + state.cached_blocks + state.used_blocks == state.total_blocks
    assert state.total_blocks == 800 and state.live_sequences == 0


def test_paths_parting_inside_a_block_share_its_first_slot_not_its_last() -> None:
    """Why a block is named by its last slot: nodes split at any token, so two cached
    paths can share a block's first slots and part before its end."""
    engine = RadixEngine(num_slots=256)
    sink = _Recorder()
    adapter = RadixAdapter(engine).attach(sink)
    common = list(range(1, 21))  # the paths part at token 20, inside block 1 (tokens 16-31)
    engine.serve([Request(common + [50] * 20, max_new_tokens=1)])
    engine.serve([Request(common + [60] * 20, max_new_tokens=1)])
    block1 = [b for b in sink.stores if b.prefix_tokens == 16]
    assert len(block1) == 2 and block1[0].tokens != block1[1].tokens
    run_a, run_b = (adapter.runs[b.block_id] for b in block1)
    assert run_a[:4] == run_b[:4]  # tokens 16-19: one node, the same slots
    assert run_a[-1] != run_b[-1] and block1[0].block_id != block1[1].block_id


def test_a_failing_translation_never_reaches_the_engine() -> None:
    engine = RadixEngine(num_slots=64)
    adapter = RadixAdapter(engine).attach(_Recorder())
    run = engine._admit(Request(list(range(20)), max_new_tokens=1))
    adapter.inserted(run, [], 0)  # slots missing: the translation itself breaks
    assert adapter.hook_errors == 1
    engine._finish(run)
    assert adapter.hook_errors == 1
