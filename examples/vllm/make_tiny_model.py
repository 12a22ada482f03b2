"""Write a tiny randomly initialised Llama (and a word-level tokenizer) to try the sidecar
without downloading a model: ``python examples/vllm/make_tiny_model.py /tmp/kvsidecar-tiny``.

Shaped for vLLM's CPU backend (head size 32, 2 KV heads, 2 layers); any real checkpoint
directory works the same way with the other examples.
"""

from __future__ import annotations

import argparse

from kvtestbed.tiny_models.tiny_llama import write_tiny_llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("path", help="directory to write the checkpoint to")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write_tiny_llama(a.path, seed=a.seed))


if __name__ == "__main__":
    main()
