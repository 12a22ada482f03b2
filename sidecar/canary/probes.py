"""Probe prompts and paired probes.

Prompts are fresh random token ids (never seen by the server, so the first send is a
guaranteed miss) with lengths on and around block boundaries: ``k*bs - 1``, ``k*bs`` and
``k*bs + 1`` tokens, where off-by-one bugs in what a hit covers live (a lookup never covers
a prompt's last token, so ``k*bs`` tokens hit ``(k-1)*bs`` and ``k*bs + 1`` hit ``k*bs``).

Two pairings:

* ``pair``: send the prompt twice; the first answer is computed from scratch (miss), the
  second reuses the first one's cached prefix (hit). Works on any server.
* ``salt``: send it twice and once more with a unique ``cache_salt`` (vLLM, SGLang), which
  isolates the request from every cached block. The salted answer is the reference; the
  unsalted first answer and the salted one are both misses, so their difference is pure
  non-cache noise, which calibrates the tolerance without trusting the cache.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from sidecar.canary.client import Completion, OpenAIClient

MODES = ("auto", "pair", "salt")  # auto: salt where the server honours cache_salt


def boundary_lengths(block_size: int, blocks: tuple[int, ...] = (1, 2, 3, 5)) -> list[int]:
    """Prompt lengths on and around block boundaries (at least 2 tokens each)."""
    out: list[int] = []
    for k in blocks:
        for n in (k * block_size - 1, k * block_size, k * block_size + 1):
            if n >= 2 and n not in out:
                out.append(n)
    return out


def expected_cached(prompt_len: int, block_size: int) -> int:
    """Tokens a prefix cache can serve for a prompt sent a second time: whole blocks, and
    never the last prompt token (its logits must be computed)."""
    return max(0, (prompt_len - 1) // block_size * block_size)


class PromptFactory:
    """Unique random prompts over token ids ``[low, high)``. Unseeded by default: a canary
    restarted with a fixed seed would resend prompts the server has already cached, and its
    "guaranteed misses" would be hits (pass a seed only to repeat a run on a fresh server)."""

    def __init__(self, low: int, high: int, seed: int | None = None) -> None:
        if not 0 <= low < high:
            raise ValueError(f"bad token range [{low}, {high})")
        self.low, self.high = low, high
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]

    def cycle(self, lengths: list[int]) -> Iterator[list[int]]:
        for n in itertools.cycle(lengths):
            yield self.prompt(n)


@dataclass
class PairResult:
    """A paired probe: ``first`` (a guaranteed miss), ``hit`` (the repeat, served from the
    cache) and, in salt mode, ``reference`` (salted: a miss whatever the cache holds)."""

    prompt_len: int
    first: Completion
    hit: Completion
    reference: Completion | None = None

    @property
    def baseline(self) -> Completion:
        """What the hit is compared with: the salted reference where there is one."""
        return self.reference if self.reference is not None else self.first

    @property
    def requests(self) -> int:
        return 3 if self.reference is not None else 2


def run_pair(client: OpenAIClient, prompt: list[int], mode: str, max_tokens: int,
             logprobs: int) -> PairResult:
    first = client.complete(prompt, max_tokens, logprobs)
    hit = client.complete(prompt, max_tokens, logprobs)
    reference = None
    if mode == "salt":
        reference = client.complete(prompt, max_tokens, logprobs,
                                    salt=f"kvsidecar-canary-{uuid.uuid4().hex}")
    return PairResult(len(prompt), first, hit, reference)
