"""Checks on one sampled block, cheapest first. Each returns findings, never raises on bad
data (bad data is what they look for); they know tensors, not engines."""

from sidecar.checks.base import Finding

__all__ = ["Finding"]
