"""The store master: `server` (the process: gRPC, fast path, tick thread, metrics), `servicer`
(its RPC handlers), `state` (everything it knows, as plain Python, made of the parts beside
it), `ha` and `recovery`.

`MasterConfig`, `MasterServer` and `run_master` are importable from here; they are loaded on
first use, so that importing `state` (tests, benchmarks) does not load gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mooncake_k8s.store.master.server import MasterConfig, MasterServer, run_master

__all__ = ["MasterConfig", "MasterServer", "run_master"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mooncake_k8s.store.master import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
