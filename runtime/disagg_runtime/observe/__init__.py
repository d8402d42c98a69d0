"""Observability artefacts made from the metric tables: the Grafana dashboard and the
Prometheus rules (`python -m disagg_runtime.observe.generate`), and `disagg up --report`."""
