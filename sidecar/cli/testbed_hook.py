"""Where the runtime reaches into the optional testbed (``kv-sidecar-testbed``,
``pip install ./testbed``; or on ``PYTHONPATH``, as in the prebuilt venvs).

Two doors, both here in :mod:`sidecar.cli` and held to that by tests/test_layout.py: the
testbed's parsers (:mod:`kvtestbed.parsers`), which the CLI and the configuration schema
(its ``[demo]`` section) build on, and what runs them (:mod:`kvtestbed.commands`, reached
from :mod:`sidecar.cli.main` only). Apart, because some benchmarks check the configuration
surface and so import the schema: one door for both would be an import circle.
"""

from __future__ import annotations

from types import ModuleType

# The testbed's commands, added by kvtestbed.parsers when the testbed is importable.
TESTBED_COMMANDS = ("demo", "faults", "bench", "actions-demo", "calibrate")
TESTBED_MISSING = ("{command}: in the kv-sidecar testbed, which is not installed "
                   "(`make demo`, or `pip install ./testbed`)")


def testbed_parsers() -> ModuleType | None:
    """:mod:`kvtestbed.parsers` when the testbed is importable, else None."""
    try:
        from kvtestbed import parsers
    except ModuleNotFoundError as exc:
        if exc.name != "kvtestbed":
            raise
        return None
    return parsers
