"""Prometheus recording and alerting rules for kv-sidecar, generated from sidecar.signals."""
