"""Our transfer engine behind SGLang's `MooncakeTransferEngine` seam (PD handoff).

SGLang's mooncake PD backend keeps its own control plane (the HTTP bootstrap registry on the
prefill server, ZMQ messages keyed by `bootstrap_room`) and calls a transfer engine for the
bytes: `batch_register` of its KV buffers, `get_session_id`, `batch_transfer_sync(session,
src addrs, dst addrs, lengths)` and `send_probe`. The plugin (`plugin.py`) swaps SGLang's class
for this one, so the KV pages go over our TCP transport (our framing, token handshake, admission
front door) into the decode process's registered buffers (`transfer.regions`).

Chosen over a backend of our own behind `--disaggregation-transfer-backend`: SGLang's backend
list is a closed enum wired into three modules, while this class is looked up by name at one
place, and keeping SGLang's bootstrap protocol means the Conductor pairs instances exactly as
SGLang's router does (bootstrap host, port and room in the request).

Granularity is SGLang's: its scheduler sends a request's KV after a forward batch (per chunk
under chunked prefill, then the last chunk), as page ranges across every layer; no hook runs
per layer, so the transfer overlaps the next chunk's compute, never the rest of one forward
pass (docs/engines.md).

Configuration comes from the environment the worker gives SGLang: `MOONCAKE_CLUSTER_TOKEN`,
`MOONCAKE_PD_HOST` (the address peers reach us on; default SGLang's own host guess) and
`MOONCAKE_PD_PORT` (default 0: any free port; ranks add their GPU index).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from mooncake_k8s.common.errors import MooncakeError
from mooncake_k8s.engine.statsfile import stats_path, write_stats
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import Peer
from mooncake_k8s.transfer.regions import RegionTable, RegionWriter
from mooncake_k8s.transfer.tcp_server import TransferServer

log = logging.getLogger(__name__)

_stats_lock = threading.Lock()
#: What this process moved; written to `$MOONCAKE_PD_STATS.pd-<pid>.json` after each batch (a few
#: per request) for the worker to export, as the HiCache backend's counters are.
STATS: dict[str, int] = {"pd_batches": 0, "pd_bytes": 0, "pd_failed": 0}


def _count(**inc: int) -> None:
    with _stats_lock:
        for k, v in inc.items():
            STATS[k] += v
        write_stats(stats_path(os.environ.get("MOONCAKE_PD_STATS"), "pd"), STATS)


class OurTransferEngine:
    """Quacks like SGLang's `MooncakeTransferEngine` (the methods its PD backend calls)."""

    def __init__(self, hostname: str, gpu_id: int | None = None,
                 ib_device: str | None = None) -> None:
        token = os.environ.get("MOONCAKE_CLUSTER_TOKEN", "")
        host = os.environ.get("MOONCAKE_PD_HOST") or hostname or "127.0.0.1"
        base_port = int(os.environ.get("MOONCAKE_PD_PORT", "0") or 0)
        self.hostname = host
        self.gpu_id = gpu_id or 0
        self.ib_device = ""  # RDMA is not used by this engine yet: TCP is logged below
        port = base_port + self.gpu_id if base_port else 0
        self._server = TransferServer({}, host=host, port=port, token=token)
        self._server.start()
        self._regions = RegionTable(self._server)
        # Regions are process memory, never shared-memory files: always TCP, even on one host.
        self._engine = TransferEngine(token, transport="tcp", timeout_s=60.0)
        self._writer = RegionWriter(self._engine)
        self.engine = self  # SGLang reads `.engine` for a few optional features
        self.session_id = self._server.address
        log.info("mooncake-k8s transfer engine serving KV buffers for PD handoff on %s (tcp)",
                 self.session_id)

    # -- registration ------------------------------------------------------------------------

    def register(self, ptr: int, length: int) -> None:
        self._regions.register([ptr], [length])

    def deregister(self, ptr: int) -> None:
        self._regions.deregister([ptr])

    def batch_register(self, ptrs: list[int], lengths: list[int]) -> int:
        try:
            self._regions.register(list(ptrs), list(lengths))
        except Exception:
            log.exception("registering %d KV buffers failed", len(ptrs))
            return -1
        return 0

    def batch_deregister(self, ptrs: list[int]) -> int:
        self._regions.deregister(list(ptrs))
        return 0

    # -- transfers ---------------------------------------------------------------------------

    @staticmethod
    def _peer(session_id: str) -> Peer:
        return Peer(session_id, session_id, f"pd:{session_id}")

    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int,
                      length: int) -> int:
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync(self, session_id: str, buffers: list[int],
                            peer_buffer_addresses: list[int], lengths: list[int]) -> int:
        """0 on success, -1 on failure (SGLang's contract: it then fails the request over)."""
        peer = self._peer(session_id)
        try:
            self._writer.write(peer, buffers, peer_buffer_addresses, lengths)
        except (MooncakeError, OSError) as e:  # a typed failure, never an exception into SGLang
            _count(pd_failed=1)
            log.warning("PD transfer to %s failed: %s", session_id, e)
            self._writer.forget(peer)
            return -1
        _count(pd_batches=1, pd_bytes=sum(lengths))
        return 0

    def send_probe(self, peer_session_id: str) -> int:
        """0 when the peer's transfer server answers (its directory is readable)."""
        try:
            self._writer.probe(self._peer(peer_session_id))
        except (MooncakeError, OSError):
            return -1
        return 0

    def get_session_id(self) -> str:
        return self.session_id

    def get_rpc_port(self) -> int:
        return self._server.port

    def get_engine(self) -> Any:
        return self

    def get_ib_device(self) -> str:
        return self.ib_device

    def close(self) -> None:
        self._engine.close()
        self._server.stop()
