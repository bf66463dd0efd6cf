"""The half of the vLLM and SGLang adapters that is the same: an engine server the worker runs
as its child (`engine.child`), behind the engine seam (`engine.api`).

Written once here: the settings every child kind takes (pass-through arguments, how long the
server may take to load), the kind's checks (installed? flags the worker owns?), starting the
server and closing it, its death as the engine's `failure()`, its HTTP errors as ours (a 4xx is
the request's fault, anything else the engine's), the load read from its own Prometheus gauges
at most every LOAD_CACHE_S, and the tenant's salt for its prefix cache. What differs (the
server's flags, the request bodies, the handoff, which gauges mean what) stays in each kind's
folder.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from mooncake_k8s.common.blocks import engine_cache_salt
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.api import EngineFailed, EngineInfo, EngineKind, EngineLoad, EngineSettings
from mooncake_k8s.engine.child import EngineChild, EngineHttpError

LOAD_CACHE_S = 0.2
"""The engine's gauges are read at most this often (the Conductor polls every worker)."""


@dataclass(frozen=True)
class ChildSettings(EngineSettings):
    """Settings every engine-server kind takes (`--engine-arg`, `--engine-ready-timeout`)."""

    args: tuple[str, ...] = ()
    """Passed through to the engine server: its own flags, except those the worker owns."""
    ready_timeout_s: float = 900.0
    """How long the engine server may take to load before the worker gives up."""


class ChildKind(EngineKind):
    """A kind whose engine is a server the worker starts: it takes pass-through arguments, owns
    some of the server's flags, and needs the server's package installed."""

    takes_args = True
    settings_type = ChildSettings


class ChildEngine(ABC):
    """One engine served by a child server: start, stop, failure, errors and load."""

    info: EngineInfo

    def __init__(self, server: EngineChild) -> None:
        self.server = server
        self._load = EngineLoad()
        self._load_at = 0.0
        self._lock = threading.Lock()
        server.start()

    def close(self) -> None:
        self.server.stop()

    def failure(self) -> str | None:
        return self.server.failure()

    def error(self, e: Exception) -> Exception:
        """An error from the server (or talking to it) as ours: its 4xx is the request's fault
        (InvalidArgument), anything else the engine's (EngineFailed, with why it died)."""
        if isinstance(e, EngineHttpError) and 400 <= e.status < 500:
            return InvalidArgument(str(e))
        return EngineFailed(self.failure() or str(e))

    def load(self) -> EngineLoad:
        """The server's own gauges, read at most every LOAD_CACHE_S (the last reading while it
        does not answer)."""
        with self._lock:
            if time.monotonic() - self._load_at < LOAD_CACHE_S or self.failure():
                return self._load
            try:
                text = self.server.metrics()
            except (OSError, EngineHttpError):
                return self._load
            self._load = self.read_load(text)
            self._load_at = time.monotonic()
            return self._load

    def step_seconds(self) -> list[float]:
        """The server times its own steps (in its own metrics), not us."""
        return []

    @abstractmethod
    def read_load(self, metrics: str) -> EngineLoad:
        """The load in the server's Prometheus text (its own metric names)."""


def with_cache_salt(body: dict[str, Any], tenant: str) -> dict[str, Any]:
    """`body` with the tenant's salt for the engine's own prefix cache (none for no tenant):
    one tenant's cached prefix never answers another's prompt."""
    salt = engine_cache_salt(tenant)
    if salt:
        body["cache_salt"] = salt
    return body


def kv_load(running: float, waiting: float, capacity: float, used_fraction: float
            ) -> EngineLoad:
    """An EngineLoad from the numbers the servers report (floats in Prometheus)."""
    cap = int(capacity)
    return EngineLoad(running=int(running), waiting=int(waiting),
                      kv_free_tokens=max(0, int(cap * (1 - used_fraction))),
                      kv_capacity_tokens=cap)
