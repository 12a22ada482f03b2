"""The "write an adapter" page's radix adapter, in the page's own words, against the test
radix engine: its blocks are verified, a clean run is quiet, a fault is caught."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from kvtestbed.docs.code_blocks import blocks

from tests.radix_engine import RadixEngine
from tests.radix_faults import ZeroRun
from tests.radix_workload import ChatConfig, chat

PAGE = Path(__file__).resolve().parent.parent / "docs" / "adapters" / "radix.md"
WORKLOAD = ChatConfig(conversations=6, turns=3, in_flight=3)


@pytest.fixture(scope="module")
def page() -> types.ModuleType:
    """The page's code blocks marked for this test, run in order as one module."""
    code = [b.code for b in blocks(PAGE)
            if b.marker == "run-by" and b.argument == "tests/test_docs_adapter.py"]
    assert len(code) >= 4, "the page lost its adapter blocks"
    module = types.ModuleType("radix_page")
    exec(compile("\n".join(code), str(PAGE), "exec"), module.__dict__)
    return module


def test_the_pages_adapter_verifies_blocks_and_a_clean_run_is_quiet(page) -> None:
    summary = page.run(RadixEngine(num_slots=4096), lambda e: chat(e, WORKLOAD)).summary()
    assert summary["verified"] > 20
    assert summary["anomalies"] == {}


def test_the_pages_adapter_catches_zeroed_slots(page) -> None:
    engine = RadixEngine(num_slots=4096, fault=ZeroRun(probability=0.5, seed=1))
    summary = page.run(engine, lambda e: chat(e, WORKLOAD)).summary()
    assert summary["anomalies"], summary
    assert set(summary["anomalies"]) & {"zeros", "recompute_mismatch", "fingerprint_mismatch"}
