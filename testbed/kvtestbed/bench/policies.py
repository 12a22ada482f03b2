"""Sampling policies at equal verification budget.

Every policy here spends one sample per ``sample_every`` hits and verifies
``blocks_per_sample`` blocks per sample (the production shape: a few blocks, not the whole
hit), so the verified-block budget is the same; what differs is *which* hits and blocks
are checked. Each (fault, policy) pair runs over several seeds (model, workload and fault
all change with the seed) and reports the median number of verified blocks from the first
affected hit to the first detection, and the affected hits caught per 1000 verified blocks.
"Detected" counts affected hits flagged on any wrong block (corrupt, or tainted by a
corrupt past): what an operator sees.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtestbed.bench.harness import Scenario, ScenarioResult, run_many

# (fault, fault probability, policies): boundary-off-by-one for the boundary-biased policy,
# zero-block (a zeroed shared block spoils every hit through it) for the adaptive one.
COMPARISONS: tuple[tuple[str, float, tuple[str, ...]], ...] = (
    ("boundary-off-by-one", 0.2, ("uniform-random-blocks", "uniform", "boundary-biased")),
    ("zero-block", 0.03, ("uniform", "adaptive")),
)


@dataclass(frozen=True)
class PolicyRow:
    fault: str
    policy: str
    runs: int
    verified_blocks: int
    affected: int
    detected: int
    caught_first: int  # runs where the fault was detected at all
    median_blocks_to_first_detection: float | None
    blocks_to_first_detection: tuple[int | None, ...]

    @property
    def detections_per_1000_blocks(self) -> float:
        return 1000 * self.detected / self.verified_blocks if self.verified_blocks else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"fault": self.fault, "policy": self.policy, "runs": self.runs,
                "verified_blocks": self.verified_blocks, "affected": self.affected,
                "detected": self.detected, "runs_detected": self.caught_first,
                "median_blocks_to_first_detection": self.median_blocks_to_first_detection,
                "blocks_to_first_detection": list(self.blocks_to_first_detection),
                "detections_per_1000_blocks": round(self.detections_per_1000_blocks, 1)}


def scenarios(seeds: int, sample_every: int, blocks_per_sample: int, requests: int,
              comparisons: Sequence[tuple[str, float, tuple[str, ...]]] = COMPARISONS,
              ) -> list[Scenario]:
    return [Scenario(fault=fault, fault_probability=prob, policy=policy, seed=seed,
                     sample_every=sample_every, blocks_per_sample=blocks_per_sample,
                     requests=requests)
            for fault, prob, policies in comparisons for policy in policies
            for seed in range(seeds)]


def summarise(results: Sequence[ScenarioResult]) -> list[PolicyRow]:
    groups: dict[tuple[str, str], list[ScenarioResult]] = {}
    for r in results:
        groups.setdefault((r.scenario.fault, r.scenario.policy), []).append(r)
    rows: list[PolicyRow] = []
    for (fault, policy), rs in groups.items():
        firsts = tuple(r.blocks_to_first_detection for r in rs)
        # A run that never caught the fault counts as worse than any that did.
        ranked = [f if f is not None else float("inf") for f in firsts]
        median = statistics.median(ranked) if ranked else None
        rows.append(PolicyRow(
            fault, policy, len(rs), sum(r.verified_blocks for r in rs),
            sum(r.affected for r in rs), sum(r.detected_any for r in rs),
            sum(1 for f in firsts if f is not None),
            median if median is None or median != float("inf") else None, firsts))
    return rows


def compare(seeds: int = 10, sample_every: int = 8, blocks_per_sample: int = 2,
            requests: int = 200, jobs: int = 1, quiet: bool = True,
            progress: Callable[[int, int, ScenarioResult], None] | None = None,
            ) -> list[PolicyRow]:
    return summarise(run_many(scenarios(seeds, sample_every, blocks_per_sample, requests),
                              jobs, quiet, progress))
