"""The transfer engine: batched reads and writes against peers' segments over the best transport.

Per peer: `shm` when the peer shares our shared-memory domain (same `host_id`) and its segment
files can be mapped, else `tcp`. A failed mapping falls back to TCP for that peer (logged once)
until `forget(peer)`. RDMA is detected and reported (`rdma_status()`), never used: `rdma`
asked for explicitly fails with the reason (no RDMA data path exists).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.netutil import local_host_id

from .ops import Peer, ReadOp, WriteOp
from .rdma import RdmaStatus, detect_rdma
from .shm import ShmMapError, ShmTransport
from .tcp import TcpTransport

log = logging.getLogger(__name__)

__all__ = ["Peer", "ReadOp", "TransferEngine", "WriteOp"]

TRANSPORTS = ("auto", "shm", "tcp", "rdma")

_rdma_lock = threading.Lock()
_rdma: RdmaStatus | None = None


def _rdma_status() -> RdmaStatus:
    global _rdma
    with _rdma_lock:
        if _rdma is None:
            _rdma = detect_rdma()
            if _rdma.available:
                log.warning(
                    "RDMA devices found (%s) but the RDMA data path is not implemented; "
                    "using TCP", _rdma.reason,
                )
            else:
                log.info("RDMA unavailable (%s), using TCP", _rdma.reason)
        return _rdma


class TransferEngine:
    """Moves bytes between caller buffers and peers' segments. Thread-safe.

    `io_timeout_s` (default: `timeout_s`) is how long a TCP peer may make no progress before
    the operation fails with `TransferTimeout`; callers with another replica to read keep it
    short (see `TcpTransport`).
    """

    def __init__(
        self,
        token: str = "",
        *,
        host_id: str | None = None,
        connections_per_peer: int = 4,
        transport: str = "auto",
        timeout_s: float = 30.0,
        io_timeout_s: float | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if connections_per_peer < 1:
            raise InvalidArgument("connections_per_peer must be >= 1")
        self.host_id = host_id or local_host_id()
        self.transport = transport
        self._token = token
        self._conns = connections_per_peer
        self._timeout = timeout_s
        self._io_timeout = io_timeout_s
        self._lock = threading.Lock()
        self._tcp: dict[str, TcpTransport] = {}
        self._shm: dict[str, ShmTransport] = {}
        self._shm_failed: set[str] = set()
        self._closed = False
        self._rdma = _rdma_status()
        if transport == "rdma":
            # Asked for explicitly: refuse at construction, never fall back silently to TCP.
            # "auto" never selects RDMA: no RDMA data path exists (untested, no device here).
            if not self._rdma.available:
                raise InvalidArgument(
                    f"transport 'rdma' asked for but unavailable: {self._rdma.reason}"
                )
            raise InvalidArgument(
                f"transport 'rdma' asked for: {self._rdma.reason}, but the RDMA data path is "
                "not implemented; use 'auto' or 'tcp'"
            )

    def rdma_status(self) -> RdmaStatus:
        return self._rdma

    # -- transports ------------------------------------------------------------------------------

    def _use_shm(self, peer: Peer) -> bool:
        if self.transport == "shm":
            return True
        if self.transport == "tcp":
            return False
        return peer.host_id == self.host_id and peer.address not in self._shm_failed

    def transport_name(self, peer: Peer) -> str:
        """"shm" or "tcp": what the next call to this peer will use."""
        return "shm" if self._use_shm(peer) else "tcp"

    def _tcp_for(self, peer: Peer) -> TcpTransport:
        t = self._tcp.get(peer.address)
        if t is None:
            with self._lock:
                if self._closed:
                    raise InvalidArgument("transfer engine is closed")
                t = self._tcp.get(peer.address)
                if t is None:
                    t = TcpTransport(peer.address, self._token, self._conns, self._timeout,
                                     self._io_timeout)
                    self._tcp[peer.address] = t
        return t

    def _shm_for(self, peer: Peer) -> ShmTransport:
        t = self._shm.get(peer.address)
        if t is None:
            with self._lock:
                if self._closed:
                    raise InvalidArgument("transfer engine is closed")
                t = self._shm.setdefault(peer.address, ShmTransport())
        return t

    def _shm_failed_for(self, peer: Peer, e: ShmMapError) -> None:
        with self._lock:
            first = peer.address not in self._shm_failed
            self._shm_failed.add(peer.address)
        if first:
            log.warning(
                "shared memory unavailable for peer, falling back to TCP: %s", e,
                extra={"peer": peer.node_id, "address": peer.address},
            )

    # -- operations ------------------------------------------------------------------------------

    def read(
        self, peer: Peer, ops: Sequence[ReadOp], with_checksum: bool = False
    ) -> list[int] | None:
        """Fill each op's `dst` from the peer's segment; xxh3-64 of each op when asked."""
        if self._use_shm(peer):
            try:
                return self._shm_for(peer).read(ops, with_checksum)
            except ShmMapError as e:
                if self.transport == "shm":
                    raise
                self._shm_failed_for(peer, e)
        return self._tcp_for(peer).read(ops, with_checksum)

    def write(
        self, peer: Peer, ops: Sequence[WriteOp], with_checksum: bool = False
    ) -> list[int] | None:
        """Copy each op's `src` into the peer's segment; xxh3-64 of each op when asked."""
        if self._use_shm(peer):
            try:
                return self._shm_for(peer).write(ops, with_checksum)
            except ShmMapError as e:
                if self.transport == "shm":
                    raise
                self._shm_failed_for(peer, e)
        return self._tcp_for(peer).write(ops, with_checksum)

    def forget(self, peer: Peer) -> None:
        """Drop cached connections and mappings for `peer` (after a failure or when it left)."""
        with self._lock:
            tcp = self._tcp.pop(peer.address, None)
            shm = self._shm.pop(peer.address, None)
            self._shm_failed.discard(peer.address)
        if tcp is not None:
            tcp.close()
        if shm is not None:
            shm.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tcps, self._tcp = list(self._tcp.values()), {}
            shms, self._shm = list(self._shm.values()), {}
        for t in tcps:
            t.close()
        for s in shms:
            s.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
