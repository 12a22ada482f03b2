"""Traffic with shared prefixes for a vLLM OpenAI server, then vLLM's own prefix-cache hit
rate: ``python examples/vllm/load.py --url http://127.0.0.1:8000 --model MODEL``.

Prompts are token ids (any vocabulary of 500+ tokens), so no tokenizer is needed: a few
prefixes of 2-6 blocks of 32 tokens, each followed by a fresh suffix, round robin.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import urllib.request


def complete(url: str, model: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def vllm_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 100, 130, 200)]
    for i in range(a.requests):
        complete(a.url, a.model, prefixes[i % len(prefixes)]
                 + [rng.randrange(3, 500) for _ in range(12)])
    hits = vllm_counter(a.url, "vllm:prefix_cache_hits_total")
    queries = vllm_counter(a.url, "vllm:prefix_cache_queries_total")
    print(json.dumps({"requests": a.requests, "vllm_prefix_cache_hits": hits,
                      "vllm_prefix_cache_queries": queries,
                      "vllm_token_hit_rate": hits / queries if queries else 0.0}))


if __name__ == "__main__":
    main()
