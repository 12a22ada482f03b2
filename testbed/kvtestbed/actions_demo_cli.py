"""The ``kv-sidecar actions-demo`` parser: kept apart from :mod:`kvtestbed.actions_demo`, which
needs the reference engine (the ``demo`` extra), so ``kv-sidecar --help`` works in a lean
install and a missing extra is named only when the demo runs."""

from __future__ import annotations

from typing import Any

DESCRIPTION = ("The background scrub and the protective actions (quarantine, circuit "
               "breaker), shown on the reference engine: --scenario scrub finds idle blocks "
               "corrupted where no hit goes; --scenario breaker shows the hit rate dip to 0 "
               "and recover.")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("actions-demo", help="background scrub / quarantine + breaker demo",
                       description=DESCRIPTION)
    p.add_argument("--scenario", choices=("scrub", "breaker"), default="breaker")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corrupt", type=int, default=4, help="blocks to corrupt")
    p.add_argument("--seconds", type=float, default=25.0,
                   help="scrub scenario: how long the scheduled scrub runs")
    p.add_argument("--budget", type=float, default=120_000.0,
                   help="scrub scenario: recompute budget, tokens per minute")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


