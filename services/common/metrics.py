"""Prometheus exposition on a dedicated address; every metric name starts with `mooncake_`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

#: Latency buckets (seconds) for data-path operations: 10 us .. 10 s.
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1.0, 2.5, 10.0,
)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics for `registry` on host:port in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
