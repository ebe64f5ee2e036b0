"""Traces (OpenTelemetry), trace files, process resources and the logger set-up: one place per concern."""
