"""What the reference engine tracks per request, shared with its faults and ground truth.

A request (:class:`Request`) becomes a :class:`RunningSequence` while it holds blocks, and a
:class:`Result` when it finishes. These live apart from the engine so the faults and the
ground truth, which act on a running sequence, need not import the engine.
:class:`EngineView` is the part of the engine a fault touches (its pool and block size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvtestbed.engines.blocks import BlockHash, KeyFields
from kvtestbed.engines.pool import BlockPool

GROUP_ID = 0
KEY_FIELD_NAMES: tuple[str, ...] = ("model_revision", "adapter", "cache_salt")


class EngineView(Protocol):
    """What a fault may reach of the engine: the pool and its block size."""

    pool: BlockPool
    block_size: int


@dataclass
class Request:
    """A prompt and its context. ``key_fields`` holds the request's ``adapter`` and
    ``cache_salt`` (missing = ""); the engine adds its own ``model_revision``."""

    tokens: list[int]
    key_fields: dict[str, str] = field(default_factory=dict)
    max_new_tokens: int = 8
    tag: str = ""  # free-form label (the workload puts conversation/turn here)


@dataclass(frozen=True)
class Result:
    """What the engine did for one request."""

    request_index: int
    request: Request
    output_tokens: tuple[int, ...]
    prompt_tokens: int
    hit_tokens: int
    latency_s: float
    rejected: bool = False


@dataclass
class RunningSequence:
    """A live request: its block table per cache group and how far its KV is written."""

    seq_id: int  # the request's index in submission order; also its pool holder id
    request: Request
    key_fields: KeyFields
    tokens: list[int]  # prompt + generated so far
    block_table: dict[int, list[int]]
    block_hashes: list[BlockHash]
    submitted: float
    hit_tokens: int = 0
    num_computed: int = 0  # positions whose KV is in the blocks
    num_cached_blocks: int = 0  # leading full blocks already indexed (hit or stored)
    output: list[int] = field(default_factory=list)
    skip_write: set[int] = field(default_factory=set)  # blocks a fault keeps unwritten

    @property
    def adapter(self) -> str:
        return dict(self.key_fields).get("adapter", "")

    @property
    def blocks(self) -> list[int]:
        return self.block_table[GROUP_ID]

    @property
    def prompt_len(self) -> int:
        return len(self.request.tokens)

    def write_path(self, index: int, block_size: int) -> str:
        """Which path wrote block ``index`` (a ``WritePath`` value): ``prefill`` when every
        position of it is a prompt token (one forward over the prompt's uncached tail),
        ``decode`` when a decode step completed it (one token a forward)."""
        return "prefill" if (index + 1) * block_size <= self.prompt_len else "decode"

    def append(self, token: int) -> None:
        """A generated token: the output and the tokens the next step runs after."""
        self.output.append(token)
        self.tokens.append(token)
