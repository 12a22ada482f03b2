"""A seeded chat workload: shared system prompts, multi-turn conversations, a few adapters.

Real prefix caches earn their hit rate from two sources, and this workload has both:

* several **system prompts** shared by many conversations (the first blocks of most prompts);
* **multi-turn chats**: each turn's prompt is the previous prompt, the model's own previous
  output and new user tokens, so a turn re-reads almost everything the last turn wrote.

The workload is closed-loop (a turn's prompt needs the previous turn's output), so it hands
out requests as conversations become ready; :func:`drive` runs it against an engine with
several conversations in flight, so blocks are shared by live sequences. Some turns are
sized so the sequence ends exactly on a block boundary (where boundary bugs live), some
prompts are exact multiples of the block size, most requests have no adapter and a few use
one of two named adapters; a few conversations carry a cache salt (tenant isolation).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtestbed.engines.engine import ReferenceEngine, Request, Result
from kvtestbed.engines.model import derive_seed


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    conversations: int = 48
    min_turns: int = 3
    max_turns: int = 8
    system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (60, 160)
    user_tokens: tuple[int, int] = (6, 30)
    max_new_tokens: int = 8
    block_size: int = 16  # to size boundary-aligned turns; match the engine's
    vocab_size: int = 256
    adapters: tuple[tuple[str, float], ...] = (("", 0.75), ("support-v2", 0.15),
                                               ("legal-v1", 0.10))
    salted_fraction: float = 0.1
    boundary_fraction: float = 0.25  # turns sized to end exactly on a block boundary
    in_flight: int = 6  # conversations open at once


@dataclass
class _Conversation:
    index: int
    turns_left: int
    adapter: str
    salt: str
    prompt: list[int]
    turn: int = 0
    waiting: bool = False


class ChatWorkload:
    """Hands out requests as their conversation becomes ready; deterministic under a seed."""

    def __init__(self, config: WorkloadConfig | None = None) -> None:
        self.config = config or WorkloadConfig()
        c = self.config
        self.rng = random.Random(derive_seed("workload", c.seed))
        self.system_prompts = [self._system_prompt(i) for i in range(c.system_prompts)]
        self._pending = deque(range(c.conversations))  # conversations not started yet
        self._open: list[_Conversation] = []
        self._by_tag: dict[str, _Conversation] = {}
        self._cursor = 0
        self.requests_issued = 0

    def _system_prompt(self, i: int) -> list[int]:
        lo, hi = self.config.system_prompt_tokens
        n = self.rng.randint(lo, hi)
        if i % 2 == 0:  # every other system prompt is an exact multiple of the block size
            n = max(self.config.block_size, n - n % self.config.block_size)
        return self._tokens(n)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.config.vocab_size) for _ in range(n)]

    def _user_turn(self, conv: _Conversation) -> list[int]:
        """New user tokens; sometimes sized so the turn's KV ends on a block boundary."""
        c = self.config
        n = self.rng.randint(*c.user_tokens)
        if self.rng.random() < c.boundary_fraction:
            written = len(conv.prompt) + n + c.max_new_tokens - 1
            n += (-written) % c.block_size
        return self._tokens(n)

    def _open_conversation(self) -> None:
        c = self.config
        index = self._pending.popleft()
        names, weights = zip(*c.adapters, strict=True)
        adapter = self.rng.choices(names, weights)[0]
        salt = f"tenant-{index % 3}" if self.rng.random() < c.salted_fraction else ""
        conv = _Conversation(index, self.rng.randint(c.min_turns, c.max_turns), adapter, salt,
                             list(self.rng.choice(self.system_prompts)))
        self._open.append(conv)

    @property
    def exhausted(self) -> bool:
        return not self._pending and not self._open

    def next_request(self) -> Request | None:
        """The next ready turn (round-robin over open conversations), or ``None`` when every
        open conversation waits for its previous turn's output (or all are done)."""
        while self._pending and len(self._open) < self.config.in_flight:
            self._open_conversation()
        for _ in range(len(self._open)):
            conv = self._open[self._cursor % len(self._open)]
            self._cursor += 1
            if conv.waiting:
                continue
            conv.prompt = conv.prompt + self._user_turn(conv)
            conv.waiting = True
            tag = f"c{conv.index}t{conv.turn}"
            self._by_tag[tag] = conv
            self.requests_issued += 1
            return Request(list(conv.prompt), {"adapter": conv.adapter, "cache_salt": conv.salt},
                           self.config.max_new_tokens, tag)
        return None

    def complete(self, result: Result) -> None:
        """Feed a finished turn back: its output becomes part of the next turn's prompt."""
        conv = self._by_tag.pop(result.request.tag)
        conv.waiting = False
        conv.turn += 1
        conv.turns_left -= 1
        if result.rejected or conv.turns_left <= 0:
            self._open.remove(conv)
            return
        conv.prompt = list(result.request.tokens) + list(result.output_tokens)


def drive(engine: ReferenceEngine, workload: ChatWorkload,
          max_requests: int | None = None,
          on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Run ``workload`` on ``engine`` until it is exhausted (or ``max_requests`` were
    issued), keeping the engine's ``max_running`` slots busy. Results in completion order;
    ``on_result`` sees each one as it finishes (progress, pacing)."""
    results: list[Result] = []
    in_engine = 0
    while True:
        while (in_engine < engine.config.max_running
               and (max_requests is None or workload.requests_issued < max_requests)):
            request = workload.next_request()
            if request is None:
                break
            engine.submit(request)
            in_engine += 1
        if engine.idle:
            break
        for result in engine.step():
            in_engine -= 1
            workload.complete(result)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def token_hit_rate(results: list[Result]) -> float:
    """Hit tokens / prompt tokens over the admitted requests."""
    admitted = [r for r in results if not r.rejected]
    query = sum(r.prompt_tokens for r in admitted)
    return sum(r.hit_tokens for r in admitted) / query if query else 0.0
