"""Fault classes of 2026 reports added to the reference engines (issue 23 item 5)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kvtestbed.engines.faults import FAULTS, make_fault
from kvtestbed.engines.hybrid_faults import fault_applies


def test_recurrent_double_apply_shifts_the_conv_window_at_an_exact_multiple_only() -> None:
    fault = make_fault("recurrent-double-apply", start_after=0)
    assert FAULTS["recurrent-double-apply"].corrupts_kv
    assert fault_applies("recurrent-double-apply", "recurrent")
    assert not fault_applies("recurrent-double-apply", "hybrid")
    engine = SimpleNamespace(block_size=4, table=lambda seq, g: [10, 11, 12])
    state = torch.arange(24.0).view(2, 3, 4)  # (layers, channels, conv window)
    exact = SimpleNamespace(seq_id=1, prompt_len=8)
    out = fault.state_to_store(engine, exact, 1, state, None)  # boundary at token 8
    assert torch.equal(out[..., :3], state[..., 1:]) and torch.equal(out[..., 3], state[..., 3])
    assert [i.block_id for i in fault.injections] == [11]
    assert fault.state_to_store(engine, exact, 0, state, None) is state  # not the prompt end
    ragged = SimpleNamespace(seq_id=2, prompt_len=9)
    assert fault.state_to_store(engine, ragged, 1, state, None) is state
    assert len(fault.injections) == 1
