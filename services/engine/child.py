"""An engine server (vLLM, SGLang) that a worker runs as its child process and talks HTTP to.

The child listens on 127.0.0.1 on a port of its own, never exposed: the worker's gRPC port is the
only way in. It runs in its own process group, so stopping it also stops the engine processes it
forked (vLLM's engine core, SGLang's scheduler and detokenizer). A child that dies takes the
worker out of service (`failure()`); the Conductor routes around it and the supervisor (or
Kubernetes) restarts the pod.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from mooncake_k8s.common.netutil import free_service_port

log = logging.getLogger(__name__)


class EngineHttpError(Exception):
    """The engine answered with an error status (the message is its own)."""

    def __init__(self, engine: str, status: int, message: str) -> None:
        super().__init__(f"{engine} answered {status}: {message}")
        self.status = status


def owned_flag(args: list[str], owned: tuple[str, ...]) -> str | None:
    """The first pass-through argument that sets a flag the worker owns."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in owned:
            return flag
    return None


class EngineChild:
    """One engine server child process. Subclasses say how to start it (`command`, `env`) and
    what "ready" means (`health_path`, `after_ready`)."""

    name = "engine"
    health_path = "/health"
    error_type: type[EngineHttpError] = EngineHttpError

    def __init__(self, role: str, ready_timeout_s: float, work_dir: Path | None) -> None:
        self.role = role
        self.ready_timeout_s = ready_timeout_s
        self.port = free_service_port("127.0.0.1")
        self._own_dir = work_dir is None
        self.dir = Path(work_dir or tempfile.mkdtemp(prefix=f"mooncake-{self.name}-{role}-"))
        self.stats_prefix = self.dir / "connector-stats"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- to override ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONSAFEPATH": "1"}

    def after_ready(self) -> None:
        """Read what the running engine reports about itself."""

    def headers(self) -> dict[str, str]:
        """Sent with every request (an API key)."""
        return {}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        log.info("starting %s", self.name, extra={"port": self.port, "role": self.role})
        self.proc = subprocess.Popen(self.command(), env=self.env(), start_new_session=True)
        # The child has its own session (so signals to the worker's group do not reach it
        # half-way): a worker that exits for any reason, even while the engine still loads,
        # must take it along.
        atexit.register(self._kill_group)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} "
                                   "while starting (its log is above)")
            with contextlib.suppress(OSError, EngineHttpError):
                if self.request("GET", self.health_path, timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} was not ready within "
                                   f"{self.ready_timeout_s:.0f} s")
            time.sleep(0.5)
        self.after_ready()

    def _kill_group(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def failure(self) -> str | None:
        if self.proc is None:
            return f"{self.name} not started"
        if self.proc.poll() is not None:
            return f"{self.name} exited with status {self.proc.returncode}"
        return None

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is not None:  # the server died: its engine processes may live on
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- HTTP ------------------------------------------------------------------------------

    def _conn(self, timeout: float | None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = 600.0) -> tuple[int, bytes]:
        conn = self._conn(timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json", **self.headers()})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            raise self.error_type(self.name, resp.status, error_message(raw))
        return resp.status, raw

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return json.loads(self.request("POST", path, body)[1])

    def stream(self, path: str, body: dict[str, Any], timeout: float = 600.0
               ) -> Generator[dict[str, Any], None, None]:
        """The `data:` events of a server-sent-event response; closing the generator hangs up,
        which makes the engine abort the request (and free its KV)."""
        conn = self._conn(timeout)
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Content-Type": "application/json", **self.headers()})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise self.error_type(self.name, resp.status, error_message(resp.read()))
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        finally:
            conn.close()

    def metrics(self) -> str:
        return self.request("GET", "/metrics", timeout=5)[1].decode()

    def connector_stats(self) -> dict[str, int]:
        """Our KV plug-ins' counters (vLLM connector, SGLang HiCache backend and transfer
        engine), summed over the engine's processes: each plug-in in each process writes
        `<stats_prefix>.<plug-in>-<pid>.json` (`engine.statsfile`)."""
        total: dict[str, int] = {}
        for f in self.dir.glob(f"{self.stats_prefix.name}.*.json"):
            try:
                for k, v in json.loads(f.read_text()).items():
                    total[k] = total.get(k, 0) + int(v)
            except (OSError, ValueError):
                continue  # replaced while we read it; the next scrape sees it
        return total


def error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return raw[:300].decode(errors="replace")
