"""kv-sidecar's testbed: the reference engines (a paged one and a hybrid one) with their faults
and workload, their adapters, the demo, the benchmarks and the tiny model configs.

None of it is the sidecar a user runs beside an engine, so it ships as a distribution of its
own (``kv-sidecar-testbed``, ``pip install ./testbed``); when it is importable, the
``kv-sidecar`` CLI gains its commands (:mod:`kvtestbed.commands`).
"""
