"""Issue 20's wiring: one block chooser (the vLLM probe's is the Monitor's, null blocks never
chosen), one verdict-listener path in a stated order with one error policy, collaborators
built by the composition function with typed dependencies (never the Monitor)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from sidecar.adapters.vllm.groups import NULL_BLOCKS, groups_from_config, groups_from_specs
from sidecar.core.compose import scrubber_for
from sidecar.core.monitor import Monitor
from sidecar.core.protocol import Hit
from sidecar.core.sampling import UniformSampler
from sidecar.core.verdict_listeners import Stage, VerdictListeners
from tests.conftest import make_toy

GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 64}


class SlidingWindowSpec:  # what vLLM's KVCacheConfig names (read by class name)
    sliding_window = 64


class FullAttentionSpec:
    sliding_window = None


def _probe_groups() -> list[Any]:
    """The groups the probe builds from the engine's own KVCacheConfig."""
    specs = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(),
                        layer_names=[f"model.layers.{i}.attn" for i in (0, 2)]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(),
                        layer_names=[f"model.layers.{i}.attn" for i in (1, 3)])])
    return [g for g, _ in groups_from_specs(specs, lambda n: int(n.split(".")[2]))]


def test_the_probe_and_the_monitor_choose_the_same_blocks_and_never_a_null_one() -> None:
    """Same hit, same seed: the probe's choice (its groups from vLLM's specs) is the one the
    Monitor makes (its groups from config.json); no null block 0, also where a group must
    hold KV (a hole there is the coverage check's, not a block to read)."""
    probe_groups, sidecar_groups = _probe_groups(), groups_from_config(GEMMA2)
    assert [(g.kind, g.null_block_ids) for g in probe_groups] == \
        [(g.kind, g.null_block_ids) for g in sidecar_groups]
    holed = {0: [0] * 6 + [0, 22], 1: [24, 25, 0, 27, 28, 29, 30, 31]}  # nulls in the window
    for blocks in ({0: [0] * 6 + [21, 22], 1: list(range(24, 32))}, holed):
        hit = Hit(tokens=list(range(256)), hit_tokens=256, blocks=blocks)
        for seed in range(20):
            probe, mon = UniformSampler(1, seed), UniformSampler(1, seed)
            for _ in range(6):  # the rotation too stays in step
                a = probe.choose(hit, 32, 4, probe_groups)
                b = mon.choose(hit, 32, 4, sidecar_groups)
                assert a == b and a
                assert not any(r.block_id in NULL_BLOCKS for r in a)


def test_listeners_run_by_stage_and_a_failing_one_is_counted_and_skipped() -> None:
    calls: list[str] = []
    ls = VerdictListeners()

    def boom(v: Any) -> None:
        calls.append("boom")
        raise RuntimeError("listener bug")

    ls.append(lambda v: calls.append("extra"))
    ls.add(lambda v: calls.append("act"), Stage.ACTIONS)
    ls.add(boom, Stage.EXPORT)
    ls.add(lambda v: calls.append("signals"), Stage.SIGNALS)
    ls.notify(object())
    ls.notify(object())
    assert calls == ["signals", "boom", "act", "extra"] * 2
    assert ls.errors == 2 and ls.errors_by == {boom.__qualname__: 2}
    ls.remove(boom)
    assert len(ls) == 3 and boom not in ls


def test_the_monitor_has_one_listener_path_in_the_stated_order() -> None:
    """Scrub, breaker and quarantine act after the signals (outlook) are complete; the
    Monitor's ``verdict_listeners`` and the reporter's are one list."""
    engine, _, mon = make_toy(scrub=True, breaker=True, quarantine=True)
    assert mon.verdict_listeners is mon.reporter.listeners
    names = [getattr(f, "__qualname__", "") for f in mon.verdict_listeners]
    assert names == ["DetectionOutlook.on_verdict", "Scrubber.on_verdict",
                     "CircuitBreaker.on_verdict", "Quarantine.on_verdict"]
    seen: list[int] = []
    mon.verdict_listeners.append(lambda v: seen.append(len(v.findings)))
    prompt = list(range(1, 17))
    engine.serve(prompt)
    engine.kv[engine.index[tuple(prompt)]][0].zero_()
    mon.verify(engine.serve(prompt + [3]))
    assert seen and seen[0] > 0  # an extra listener sees the verdict once, after the rest


def test_collaborators_get_typed_dependencies_not_the_monitor() -> None:
    _engine, adapter, mon = make_toy(scrub=True, breaker=True)
    scrubber = mon.scrubber
    assert scrubber is not None and not hasattr(scrubber, "monitor")
    deps = vars(scrubber.deps)
    assert not any(isinstance(v, Monitor) for v in deps.values())
    assert deps["adapter"] is adapter and deps["metrics"] is mon.metrics
    again = scrubber_for(mon, dataclasses.replace(scrubber.settings, seed=5))
    assert again.deps.cache is mon.cache and again.seed == 5
    breaker = mon.actions.breaker
    assert breaker is not None
    for _ in range(mon.config.breaker_anomalies):  # the breaker's switch is the Monitor's flag
        breaker.on_verdict(SimpleNamespace(findings=[1], anomalous=True))  # type: ignore[arg-type]
    assert breaker.open and mon.hits_allowed is False


def test_one_byte_view_for_digests_wire_and_evidence_files() -> None:
    """bf16, float8, bool, 0-dim and strided tensors: the digest's bytes, the probe's wire
    bytes and the safetensors body are the same C-order bytes (round trips exact)."""
    import torch

    from sidecar.adapters.vllm.wire import tensor_bytes as wire_bytes
    from sidecar.adapters.vllm.wire import tensor_from
    from sidecar.checks.fingerprint import tensor_bytes as digest_bytes
    from sidecar.core.tensor_bytes import byte_view
    from sidecar.evidence.safetensors_io import dumps, loads

    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7
    cases = [base, base.to(torch.bfloat16), base.to(torch.float8_e4m3fn), base > 1,
             base.transpose(0, 2), torch.tensor(3.5), torch.empty(0, 4)]
    for t in cases:
        raw = bytes(byte_view(t))
        assert len(raw) == t.numel() * t.element_size()
        assert bytes(digest_bytes(t)) == wire_bytes(t) == raw
        if t.dtype is not torch.bool and t.dim():  # KV dtypes and shapes only on the wire
            back = tensor_from(raw, str(t.dtype).removeprefix("torch."), list(t.shape))
            assert bytes(byte_view(back)) == raw and back.shape == t.shape
        if t.dtype in (torch.float32, torch.bfloat16, torch.bool):
            got, _ = loads(dumps({"t": t}))
            assert torch.equal(got["t"], t)
