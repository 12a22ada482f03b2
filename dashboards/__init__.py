"""Grafana dashboards for kv-sidecar, as code (grafanalib) generating committed JSON."""
