"""Anomaly evidence: the records written per anomaly, reading them back, `kv-sidecar
evidence`, plots and tensor files."""
