"""`/metrics`, `/healthz` and `/readyz` over plain HTTP for the gRPC workers.

Kubernetes probes and Prometheus speak HTTP, the workers speak gRPC; this small threaded server
sits beside the gRPC one. Readiness asks the service (model loaded, store reachable, not
draining), so a pod leaves its Service while it drains. Liveness says the process answers and,
where the service passes `alive` (the workers pass their `Watchdog`), that its engine still makes
progress: a hung engine turns /healthz 503, so the kubelet restarts the pod.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)
HANG_ENV = "MOONCAKE_TEST_HANG_ENGINE"


class Watchdog:
    """Notices an engine that stopped making progress while work waits on it.

    Callers wrap each call into the engine that should come back (a prefill, the next token of
    a stream) in `waiting()`; a call that returns, or raises, is progress. `stalled()` names the
    stall once some call has waited longer than `stall_s` and no other call came back meanwhile:
    an idle engine is never stalled, a slow one is as long as anything it serves moves.
    """

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self._lock = threading.Lock()
        self._waits: dict[int, float] = {}
        self._next = 0
        self._last = clock()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._waits[key] = self._clock()
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]
                self._last = self._clock()

    def stalled(self) -> str | None:
        """None while the engine is alive (idle, or something it serves moves), else why not."""
        with self._lock:
            if not self._waits:
                return None
            since = max(self._last, min(self._waits.values()))
            waiting = len(self._waits)
        age = self._clock() - since
        if age <= self.stall_s:
            return None
        return (f"the engine made no progress for {age:.0f} s while {waiting} call(s) waited on "
                f"it (limit {self.stall_s:g} s)")


def injected_hang(point: str) -> None:
    """Test-only fault: block the calling thread for good when MOONCAKE_TEST_HANG_ENGINE names
    `point` (a worker role), the way a deadlocked engine would. The liveness tests hang a real
    worker's engine path with it; nothing sets it in a deployment."""
    if os.environ.get(HANG_ENV) == point:
        log.warning("%s=%s: hanging this engine call on purpose (tests only)", HANG_ENV, point)
        threading.Event().wait()


class HealthServer:
    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, ready: Callable[[], str | None],
        alive: Callable[[], str | None] | None = None,
    ) -> None:
        """`ready()` returns None when ready, else the reason it is not (sent with the 503);
        `alive()` the same for /healthz (without it, answering is alive enough)."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    dead = outer.alive() if outer.alive is not None else None
                    if dead is None:
                        self._send(200, b"ok\n")
                    else:
                        self._send(503, f"not alive: {dead}\n".encode())
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
        self.alive = alive
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
