"""Test-only radix-cache backend ``kv-sidecar-faults``: kv-sidecar's tapped tree with a fault
hook *below* the tap, driven over a ZMQ REP socket (``KVSIDECAR_SGLANG_FAULTS``).

Loaded into SGLang's processes through a test-only plugin entry point (the dist-info under
tests/sglang/shims, on the test server's PYTHONPATH only). Commands are applied on the
scheduler's thread at the next ``match_prefix``, so they never race SGLang. Each edits
SGLang's real structures:

* ``zero``: zero the K/V of the tree's slots for a prefix (every layer);
* ``free``: hand the tree's slots for a prefix back through the allocator's ``free`` while
  the tree still holds them (a premature free; SGLang's own metrics path then asserts on a
  negative usage at the next prefill report and the scheduler exits);
* ``reuse``: the same free, then the slots handed out again at once (``alloc``) to an owner
  that writes another cached prefix's K/V into them (a slot freed while in the tree and
  reused; SGLang's counts stay consistent, so it keeps serving);
* ``stale``: copy the K/V of another cached prefix's slots over this prefix's (stale reuse);
* ``drop_extra_key``: match and insert without the request's ``extra_key`` (the namespace
  dropped from the key), until turned off.

On a hybrid SWA server (two pools; a full slot reaches its SWA slot through SGLang's
``full_to_swa_index_mapping``), three more edit the sliding-window layers' pool only:

* ``zero_swa``: zero the SWA K/V of a prefix's slots;
* ``stale_swa``: copy another cached prefix's SWA K/V over this prefix's;
* ``swa_reuse``: a freed SWA slot served: the prefix's SWA slots go back to the SWA
  allocator while the mapping still names them (a tombstone that forgot the mapping), and
  are handed out again at once to an owner that writes another prefix's SWA K/V there;
* ``swa_diverged`` (a query, not a fault): how many full slots have an SWA peer with
  another id;
* ``tombstone_swa``: a tombstoned SWA slot served: the prefix's full slots lose their SWA
  peers (the mapping cleared, as SGLang's tombstone does) while the tree still serves the
  prefix whole. The SWA slots themselves stay allocated: freeing them too (SGLang's whole
  ``free_swa``) is caught by SGLang's own idle leak check, which exits the server.
"""

from __future__ import annotations

import json
import os
from array import array
from typing import Any

import torch
import zmq

ENV = "KVSIDECAR_SGLANG_FAULTS"


class Faults:
    def __init__(self, endpoint: str, tree: Any) -> None:
        self.match, self.insert = tree.match_prefix, tree.insert  # SGLang's own
        tree.match_prefix = lambda params: (self.poll(tree), self.match(
            self.key_params(params)))[1]
        tree.insert = lambda params: self.insert(self.key_params(params))
        self.sock = zmq.Context.instance().socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.drop_extra_key = False

    def key_params(self, params: Any) -> Any:
        if not self.drop_extra_key or params.key is None or params.key.extra_key is None:
            return params
        import dataclasses

        from sglang.srt.mem_cache.radix_cache import RadixKey

        k = params.key
        return dataclasses.replace(params, key=RadixKey(
            k.token_ids, None, is_bigram=k.is_bigram, limit=k.limit, cache_salt=k.cache_salt))

    def poll(self, tree: Any) -> None:
        while self.sock.poll(0):
            cmd = json.loads(self.sock.recv())
            try:
                reply = self.apply(tree, cmd)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.sock.send(json.dumps(reply).encode())

    def _slots(self, tree: Any, tokens: list[int]) -> torch.Tensor:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        res = self.match(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        path = tree.path_device_indices(res.last_device_node)
        return path[:res.device_prefix_len].to(torch.int64)

    def apply(self, tree: Any, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "drop_extra_key":
            self.drop_extra_key = bool(cmd["on"])
            return {"ok": True}
        if op == "swa_diverged":  # not a fault: full slots whose SWA peer has another id
            mapping = tree.token_to_kv_pool_allocator.full_to_swa_index_mapping[:-1]
            ids = torch.arange(len(mapping), device=mapping.device)
            return {"ok": True, "diverged": int(((mapping != 0) & (mapping != ids)).sum())}
        slots = self._slots(tree, cmd["tokens"])
        pool = tree.token_to_kv_pool_allocator.get_kvcache()
        if "swa" in op:
            return self.apply_swa(tree, op, slots, cmd)
        if op == "zero":
            for buf in (*pool.k_buffer, *pool.v_buffer):
                buf[slots] = 0
        elif op == "stale":
            src = self._slots(tree, cmd["source"])[:len(slots)]
            slots = slots[:len(src)]
            for buf in (*pool.k_buffer, *pool.v_buffer):
                buf[slots] = buf[src]
        elif op in ("free", "reuse"):
            alloc = tree.token_to_kv_pool_allocator
            alloc.free(slots)  # through SGLang's own free (the tap sees it)
            rest = torch.cat([alloc.free_pages, alloc.release_pages])
            rest = rest[~torch.isin(rest, slots)]
            alloc.free_pages = torch.cat([slots, rest])
            alloc.release_pages = alloc.release_pages[:0]
            if op == "reuse":  # handed out again at once, and written by its new owner
                taken = alloc.alloc(len(slots))
                src = self._slots(tree, cmd["source"])[:len(taken)]
                for buf in (*pool.k_buffer, *pool.v_buffer):
                    buf[taken[:len(src)]] = buf[src]
                slots = taken
        else:
            raise ValueError(f"unknown fault {op!r}")
        return {"ok": True, "slots": [int(s) for s in slots.tolist()]}


    def apply_swa(self, tree: Any, op: str, slots: torch.Tensor,
                  cmd: dict[str, Any]) -> dict[str, Any]:
        top = tree.token_to_kv_pool_allocator
        mapping = top.full_to_swa_index_mapping
        swa_pool = top.get_kvcache().swa_kv_pool
        bufs = (*swa_pool.k_buffer, *swa_pool.v_buffer)
        swa = mapping[slots].to(torch.int64)
        swa = swa[swa > 0]  # slots whose SWA K/V SGLang still keeps
        if op == "tombstone_swa":
            top.clear_full_to_swa_mapping(slots)
            return {"ok": True, "slots": [int(s) for s in swa.tolist()]}
        if op == "zero_swa":
            for buf in bufs:
                buf[swa] = 0
            return {"ok": True, "slots": [int(s) for s in swa.tolist()]}
        src = mapping[self._slots(tree, cmd["source"])].to(torch.int64)
        src = src[src > 0][:len(swa)]
        swa = swa[:len(src)]
        if op == "stale_swa":
            for buf in bufs:
                buf[swa] = buf[src]
            return {"ok": True, "slots": [int(s) for s in swa.tolist()]}
        if op != "swa_reuse":
            raise ValueError(f"unknown fault {op!r}")
        alloc = top.swa_attn_allocator
        kept = alloc.free_pages.clone(), alloc.release_pages.clone()
        alloc.free(swa)  # back to the SWA allocator; the mapping still names them
        rest = torch.cat([alloc.free_pages, alloc.release_pages])
        rest = rest[~torch.isin(rest, swa)]
        alloc.free_pages = torch.cat([swa, rest])
        alloc.release_pages = alloc.release_pages[:0]
        taken = alloc.alloc(len(swa))  # the new owner, writing another prefix's K/V
        for buf in bufs:
            buf[taken] = buf[src]
        # The same slots are handed out again: put the free lists back as they were, so
        # the SWA allocator keeps handing out the ids the full one does (on this CPU,
        # SGLang's attention reads sliding layers at full ids: see test_swa.py).
        alloc.free_pages, alloc.release_pages = kept
        return {"ok": True, "slots": [int(s) for s in taken.tolist()]}


def faulty_tree(ctx: Any) -> Any:
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from sidecar.adapters.sglang.backend import attach, make_tap

    tap = make_tap(ctx)
    tree = default_radix_cache_factory(ctx)
    tree._kvs_faults = Faults(os.environ[ENV], tree)  # wraps first: below the tap
    return attach(tree, tap)


def register() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if "kv-sidecar-faults" not in registered_radix_cache_backends():
        register_radix_cache_backend("kv-sidecar-faults", faulty_tree)
