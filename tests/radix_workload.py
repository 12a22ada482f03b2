"""A seeded multi-turn chat workload for the radix engine, and the harness that runs it
under a real Monitor (tests only).

Shared system prompts and growing conversations give the tree its shape: many paths share
a first node, each turn extends its conversation's leaf, user turns have any length (so
nodes split and blocks span node boundaries), and a few conversations use an adapter (a
separate namespace: same tokens, other KV). Requests run in batches from different
conversations, so eviction for one runs while the others hold locks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit
from tests.limits import DETECTION_TIMEOUT_S
from tests.radix_adapter import RadixAdapter
from tests.radix_engine import RadixEngine, Request
from tests.radix_faults import RadixFault


@dataclass(frozen=True)
class ChatConfig:
    seed: int = 0
    conversations: int = 24
    turns: int = 5
    batch: int = 4
    in_flight: int = 8
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (100, 200)
    user_tokens: tuple[int, int] = (8, 40)
    max_new_tokens: int = 2
    adapters: tuple[str, ...] = ("", "", "", "support", "legal")


def chat(engine: RadixEngine, config: ChatConfig, poll: Monitor | None = None) -> int:
    """Run the workload; ``poll`` (a Monitor) checks the allocator after every batch.
    Returns the number of requests served."""
    rng = random.Random(config.seed)
    vocab = engine.model.config.vocab_size
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*config.system_tokens))]
               for _ in range(config.system_prompts)]
    convs = [(list(rng.choice(systems)), rng.choice(config.adapters))
             for _ in range(config.conversations)]
    served = 0
    for wave in range(0, len(convs), config.in_flight):  # conversations open at once
        open_ = list(range(wave, min(wave + config.in_flight, len(convs))))
        for _ in range(config.turns):
            rng.shuffle(open_)
            for start in range(0, len(open_), config.batch):
                ids = open_[start:start + config.batch]
                for i in ids:
                    convs[i][0].extend(rng.randrange(vocab) for _ in range(
                        rng.randint(*config.user_tokens)))
                batch = [Request(list(convs[i][0]), config.max_new_tokens, convs[i][1])
                         for i in ids]
                for i, out in zip(ids, engine.serve(batch), strict=True):
                    convs[i][0].extend(out or [])
                served += len(batch)
                if poll is not None:
                    poll.poll_allocator()
    return served


class SlowReads(RadixAdapter):
    """The verifier's read arrives late (a busy sidecar): the tree has moved on meanwhile.
    The capture, on the engine's thread, is not delayed."""

    delay_s = 0.0

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        time.sleep(self.delay_s)
        return super().read(hit, refs)

    capture = RadixAdapter.read


def monitored(num_slots: int, fault: RadixFault | None = None, delay_s: float = 0.0,
              blocks_per_sample: int = 16, capture: bool = True, start: bool = True
              ) -> tuple[RadixEngine, RadixAdapter, Monitor]:
    """A radix engine with its adapter feeding a real Monitor that verifies every hit
    (recompute unthrottled), its worker started unless ``start`` is false (then samples
    wait in the queue, snapshotted at match time, until the caller starts it)."""
    engine = RadixEngine(num_slots, fault=fault)
    adapter = SlowReads(engine)
    adapter.delay_s = delay_s
    mon = Monitor(adapter, SidecarConfig(sample_every=1, blocks_per_sample=blocks_per_sample,
                                         recompute_tokens_per_s=0, queue_size=10_000,
                                         capture=capture, adapter_timeout_s=DETECTION_TIMEOUT_S,
                                         allocator_check_min_interval_s=-1),
                  registry=CollectorRegistry())
    adapter.attach(mon)
    return engine, adapter, mon.start() if start else mon
