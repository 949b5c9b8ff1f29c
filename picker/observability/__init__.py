"""Observability: every metric the picker exports (`metrics.py`, the one owner of metric names) and
its OpenTelemetry traces (`tracing.py`). Imported by the request path as hooks; imports the contract
and the planes it reads (pool, scheduling, streams), never the request path or a frontend."""
