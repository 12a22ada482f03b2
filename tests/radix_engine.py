"""A small SGLang-style radix-tree engine over a token-slot KV pool (tests only).

The second cache shape the sidecar is checked against, next to the paged reference engine:

* **KV pool**: one *slot* per token. ``pool_k``/``pool_v`` have shape
  ``(num_slots, layers, kv_heads, head_dim)``; a sequence's KV is wherever its slots are,
  in any order (slots are handed out one by one from a FIFO free list, so after some churn
  a prefix's slots are scattered). Nothing is paged: no block table, no block hash.
* **Radix tree**: each node owns a run of tokens and, in parallel, the slots holding their
  KV. Nodes split at any token (page size 1, SGLang's default); one tree per namespace (the
  request's adapter and model revision: SGLang's ``extra_key``), so a request only matches
  KV computed under its own key.
* **Lock refs**: a running request locks the node its match ended at and every ancestor;
  eviction only takes unlocked leaves, least recently used first (a parent whose last
  child goes becomes a leaf itself).
* **Requests** run in batches: every request of a batch is admitted (match, lock, prefill)
  before any decodes, so eviction for one request runs while the others hold their
  prefixes; at the end each request's tokens are inserted into the tree, the slots of a
  part some other request inserted meanwhile are freed, and its lock is dropped.

Prefill and decode run through the reference engine's tiny HF model
(:mod:`kvtestbed.engines.model`) with the past gathered from the pool, so cached
KV is real: corrupting a slot changes what the model computes after it.

The engine knows nothing of kv-sidecar. A *listener* (the adapter, :mod:`tests.radix_adapter`)
is told what a real integration would hook: a match, an insertion, an eviction, a finished
request. Faults (:mod:`tests.radix_faults`) override one engine step each.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvtestbed.engines.model import ModelConfig, SequenceKV, TinyLlama


@dataclass(eq=False)
class Node:
    """A run of tokens and the slots holding their KV; ``start`` is the run's position in
    the path from the root (the number of tokens before it)."""

    tokens: list[int]
    slots: list[int]
    parent: Node | None
    start: int
    children: dict[int, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def path_slots(self) -> list[int]:
        """Slots of the whole path from the root to the end of this node."""
        runs: list[list[int]] = []
        node: Node | None = self
        while node is not None:
            runs.append(node.slots)
            node = node.parent
        return [s for run in reversed(runs) for s in run]


@dataclass
class Request:
    tokens: list[int]
    max_new_tokens: int = 4
    adapter: str = ""


@dataclass
class Running:
    """A request being served: its locked match and the slots it holds privately."""

    rid: int
    request: Request
    namespace: tuple[str, ...]
    node: Node  # where the match ended (locked, with its ancestors)
    matched: list[int]  # slots of the matched prefix (owned by the tree)
    private: list[int] = field(default_factory=list)  # slots of tokens it computed
    tokens: list[int] = field(default_factory=list)  # every token with KV in a slot
    output: list[int] = field(default_factory=list)
    tag: int = 0  # chained hash of (namespace, tokens) so far: the next slot's tag builds on it
    started: float = 0.0
    failed: bool = False


def path_tag(ns: tuple[str, ...], tokens: Sequence[int]) -> int:
    """The chained hash of ``tokens`` under namespace ``ns`` (a slot's content tag)."""
    h = hash(ns)
    for t in tokens:
        h = hash((h, t))
    return h


class OutOfSlots(RuntimeError):
    pass


class RadixEngine:
    def __init__(self, num_slots: int, block_size: int = 16, model: ModelConfig | None = None,
                 fault: Any = None, listener: Any = None) -> None:
        from tests.radix_faults import RadixFault

        self.model = TinyLlama(model or ModelConfig())
        mc = self.model.config
        self.block_size = block_size  # the listener's unit of verification; the tree has none
        self.num_slots = num_slots
        shape = (num_slots, mc.num_layers, mc.num_kv_heads, mc.head_dim)
        self.pool_k = torch.zeros(shape, dtype=self.model.dtype)
        self.pool_v = torch.zeros(shape, dtype=self.model.dtype)
        # Per slot, the chained hash of (namespace, tokens up to it) it was written for: the
        # content tag a slot-ownership snapshot compares the tree with.
        self.tags: list[int | None] = [None] * num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.roots: dict[tuple[str, ...], Node] = {}
        self.running: dict[int, Running] = {}
        self.fault: RadixFault = fault or RadixFault()
        self.listener = listener
        self.lock = threading.RLock()  # held for tree and pool updates, never for a forward
        self._clock = itertools.count(1)
        self._rids = itertools.count()
        self.allocations = self.allocation_failures = self.evicted_nodes = 0

    # ------------------------------------------------------------------ tree
    def namespace(self, request: Request) -> tuple[str, ...]:
        return self.fault.namespace(request, (self.model.config.revision, request.adapter))

    def _root(self, ns: tuple[str, ...]) -> Node:
        return self.roots.setdefault(ns, Node([], [], None, 0))

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its ``k``-th token; returns the new parent holding the head."""
        assert node.parent is not None and 0 < k < len(node.tokens)
        head = Node(node.tokens[:k], node.slots[:k], node.parent, node.start,
                    lock_ref=node.lock_ref, last_access=node.last_access)
        node.parent.children[head.tokens[0]] = head
        node.tokens, node.slots = node.tokens[k:], node.slots[k:]
        node.parent, node.start = head, node.start + k
        head.children[node.tokens[0]] = node
        return head

    def _walk(self, root: Node, tokens: Sequence[int]) -> tuple[Node, int]:
        """The deepest node whose path is a prefix of ``tokens`` (split so it ends exactly
        at the match), and the match length."""
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = 0
            while k < len(child.tokens) and pos + k < len(tokens) \
                    and child.tokens[k] == tokens[pos + k]:
                k += 1
            if k < len(child.tokens):
                child = self._split(child, k)
            node, pos = child, pos + k
        return node, pos

    def _touch(self, node: Node, lock: int = 0) -> None:
        now = next(self._clock)
        n: Node | None = node
        while n is not None:
            n.last_access = now
            n.lock_ref += lock
            n = n.parent

    def _insert(self, run: Running, slots: list[int]) -> int:
        """Insert a finished request's tokens; returns how many were in the tree already
        (their slots in ``slots`` are the caller's to free)."""
        tokens = run.tokens
        root = self._root(run.namespace)
        node, cached = self._walk(root, tokens)
        if cached < len(tokens):
            leaf = Node(tokens[cached:], slots[cached:], node, cached)
            node.children[tokens[cached]] = leaf
            node = leaf
        self._touch(node)
        if self.listener is not None and cached < len(tokens):
            self.listener.inserted(run, node.path_slots(), cached)
        if cached < len(tokens):
            self.fault.after_insert(self, node)
        return cached

    def _evict(self, need: int) -> None:
        """Free unlocked leaves, least recently used first, until ``need`` slots are free."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children
                and n.lock_ref == 0 and n.parent is not None]
        heapq.heapify(heap)
        while len(self.free) < need and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.listener is not None:
                self.listener.evicted(leaf.path_slots(), leaf.start)
            del parent.children[leaf.tokens[0]]
            self.free.extend(leaf.slots)
            self.evicted_nodes += 1
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    # ------------------------------------------------------------------ pool
    def _alloc(self, n: int) -> list[int]:
        self.allocations += 1
        if len(self.free) < n:
            self._evict(n)
        if len(self.free) < n:
            self.allocation_failures += 1
            raise OutOfSlots(f"{n} slots needed, {len(self.free)} free after eviction")
        return [self.free.popleft() for _ in range(n)]

    def _past(self, slots: Sequence[int]) -> SequenceKV | None:
        if not slots:
            return None
        idx = torch.tensor(list(slots), dtype=torch.long)
        # (tokens, layers, heads, dim) -> (layers, heads, tokens, dim)
        return SequenceKV(self.pool_k[idx].permute(1, 2, 0, 3),
                          self.pool_v[idx].permute(1, 2, 0, 3))

    def _write(self, run: Running, kv: SequenceKV, tokens: Sequence[int]) -> None:
        slots = self._alloc(len(tokens))
        idx = torch.tensor(slots, dtype=torch.long)
        self.pool_k[idx] = kv.keys.permute(2, 0, 1, 3)
        self.pool_v[idx] = kv.values.permute(2, 0, 1, 3)
        h = run.tag
        for s, t in zip(slots, tokens, strict=True):
            h = hash((h, t))
            self.tags[s] = h
        run.tag = h
        run.private.extend(slots)
        run.tokens.extend(tokens)

    # ------------------------------------------------------------------ requests
    def serve(self, batch: Sequence[Request]) -> list[list[int] | None]:
        """Run a batch; each request's generated tokens, ``None`` where it ran out of slots."""
        runs = [self._admit(r) for r in batch]
        for _ in range(max((r.max_new_tokens for r in batch), default=0) - 1):
            for run in runs:
                if not run.failed and len(run.output) < run.request.max_new_tokens:
                    self._decode(run)
        for run in runs:
            self._finish(run)
        return [None if run.failed else run.output for run in runs]

    def _admit(self, request: Request) -> Running:
        if len(request.tokens) < 2:
            raise ValueError("a prompt needs at least two tokens")
        with self.lock:
            ns = self.namespace(request)
            # At least one token is always computed: its logits give the first output.
            node, matched = self._walk(self._root(ns), request.tokens[:-1])
            self._touch(node, lock=+1)
            run = Running(next(self._rids), request, ns, node, node.path_slots(),
                          tokens=list(request.tokens[:matched]), started=time.perf_counter())
            run.tag = path_tag(ns, run.tokens)
            self.running[run.rid] = run
            if self.listener is not None:
                self.listener.matched(run, matched)
            past = self._past(run.matched)
        rest = request.tokens[matched:]
        out = self.model.forward(rest, request.adapter, past)
        with self.lock:
            self._try_write(run, out.kv, rest)
        run.output.append(out.next_token)
        return run

    def _decode(self, run: Running) -> None:
        token = run.output[-1]
        with self.lock:
            past = self._past(run.matched + run.private)
        assert past is not None  # the prefill wrote at least one slot
        out = self.model.decode_step(token, run.request.adapter, past)
        with self.lock:
            self._try_write(run, out.kv, [token])
        run.output.append(out.next_token)

    def _try_write(self, run: Running, kv: SequenceKV, tokens: Sequence[int]) -> None:
        try:
            self._write(run, kv, tokens)
        except OutOfSlots:
            run.failed = True

    def _finish(self, run: Running) -> None:
        with self.lock:
            matched = len(run.matched)
            slots = run.matched + run.private
            if not run.failed:
                cached = self._insert(run, slots)
                lo, hi = self.fault.duplicate_range(matched, cached, self.block_size)
                self.free.extend(slots[lo:hi])  # computed twice: the tree keeps its own
            else:
                self.free.extend(run.private)
            self._touch(run.node, lock=-1)
            del self.running[run.rid]
            if self.listener is not None:
                self.listener.finished(time.perf_counter() - run.started)

    # ------------------------------------------------------------------ introspection
    def tree_slots(self) -> list[tuple[Node, int, int]]:
        """Every (node, slot, path tag) the tree names, the tag recomputed from the tree's
        own tokens (what the slot *should* hold), in LRU order of nodes."""
        out: list[tuple[Node, int, int]] = []
        for ns, root in self.roots.items():
            stack: list[tuple[Node, int]] = [(root, hash(ns))]
            while stack:
                node, h = stack.pop()
                for s, t in zip(node.slots, node.tokens, strict=True):
                    h = hash((h, t))
                    out.append((node, s, h))
                stack.extend((c, h) for c in node.children.values())
        out.sort(key=lambda e: e[0].last_access)
        return out
