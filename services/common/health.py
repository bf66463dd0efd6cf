"""`/metrics`, `/healthz` and `/readyz` over plain HTTP for the gRPC workers.

Kubernetes probes and Prometheus speak HTTP, the workers speak gRPC; this small threaded server
sits beside the gRPC one. Liveness only says the process answers; readiness asks the service
(model loaded, store reachable, not draining), so a pod leaves its Service while it drains.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class HealthServer:
    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, ready: Callable[[], str | None]
    ) -> None:
        """`ready()` returns None when ready, else the reason it is not (sent with the 503)."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    reason = outer.ready()
                    if reason is None:
                        self._send(200, b"ready\n")
                    else:
                        self._send(503, f"not ready: {reason}\n".encode())
                else:
                    self._send(404, b"not found; try /metrics, /healthz or /readyz\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds would drown the structured log

        self.registry = registry
        self.ready = ready
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-http", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def stop_requested() -> threading.Event:
    """An event set by SIGTERM or SIGINT: what every long-running command waits on before it
    drains and stops. Call from the main thread (signal handlers can only be set there)."""
    done = threading.Event()

    def _on_signal(_signum: int, _frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return done
