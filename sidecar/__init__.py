"""kv-sidecar: verifies that an LLM engine's KV-cache hits hold the right KV."""

__version__ = "0.1.0"
