"""Benchmarks (``kv-sidecar bench ...``): commands that print a table and, with ``--json``,
one JSON object. ``detection``: every catalogued fault against the sidecar, per dtype;
``perf``: what the sidecar costs the engine, against baselines measured in the same run.

The command itself is in :mod:`kvtestbed.bench.entry`: kept out of this ``__init__``, which
every import of a bench module runs, so importing one bench never reaches the others."""
