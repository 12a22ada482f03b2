"""Engines kv-sidecar ships for demos, tests and benchmarks."""
