"""Exports: Prometheus metrics and exposition, the HTTP server (/metrics, /healthz,
/status), OpenTelemetry, the run summary."""
