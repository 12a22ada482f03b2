"""SGLang adapter: a radix-cache backend that taps SGLang's live tree, and its sidecar.

Importing this package (or :mod:`.tap`, :mod:`.census`, :mod:`.service`) never imports
SGLang; :mod:`.backend` does, lazily, inside SGLang's own processes.

* :mod:`.backend` (runs in SGLang): ``--radix-cache-backend kv-sidecar``, SGLang's default
  tree and allocator re-classed so their hooks report to :mod:`.tap`;
* :mod:`.tap` (runs in SGLang): lookups, sampled captures, stores, frees and the slot
  census, over the same bounded pipe as vLLM's probe (:mod:`sidecar.adapters.vllm.pipe`);
* :mod:`.service`, :mod:`.census`, :mod:`.metrics_bridge`, :mod:`.cli` (the sidecar): the
  Monitor with the HF reference, slot-level allocator invariants, SGLang's /metrics audited.

Blocks on a slot tree. A radix tree holds token *slots* and splits at any token, so there
are no engine blocks to name. The sidecar's blocks are its own: ``block_size``-aligned runs
of a path's positions (tokens ``i*bs .. (i+1)*bs``), each named by the slot of its *last*
token. Not the first slot: two paths that part inside a block share its first slots, while a
slot belongs to one node at one position, so the last slot names the whole token prefix
(the same choice as the radix test engine's adapter, tests/radix_notes.md). A block may span
two nodes; the tap reads its slots from the request's row (``req_to_token``), which is the
tree's path for the matched prefix, so no per-block slot map is kept. Per-block handles
grouping ``page_size * k`` slots were the alternative: they tie the sidecar's unit to
SGLang's page size (1 on this CPU path) and still need the last-slot rule inside a page
when pages are partly shared. A hit's partial last block is served but not verified.
"""
