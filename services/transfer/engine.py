"""The transfer engine: batched reads and writes against peers' segments over the best transport.

Per peer: `shm` when the peer shares our shared-memory domain (same `host_id`) and its segment
files can be mapped, else `tcp`. A failed mapping falls back to TCP for that peer (logged once)
until `forget(peer)`.

RDMA (`rdma_verbs`) is used only when asked for (`transport="rdma"`), never by "auto": it is
untested on hardware (see `rdma`). Asked for where `detect_rdma()` finds no device or no
pyverbs, or where the device cannot be opened, the engine refuses at construction with the
reason. With it, every peer is reached over RDMA; a peer that answers that it cannot serve RDMA
is reached as "auto" would reach it (shm on the same host, else TCP; logged once, counted by
`rdma_fallbacks()`) until `forget(peer)`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.netutil import local_host_id
from mooncake_k8s.transfer.ops import Peer, ReadOp, TransferRejected, WriteOp
from mooncake_k8s.transfer.rdma import RdmaStatus, cached_rdma_status, rdma_state
from mooncake_k8s.transfer.shm import ShmMapError, ShmTransport
from mooncake_k8s.transfer.tcp import TcpTransport

log = logging.getLogger(__name__)

__all__ = ["Peer", "ReadOp", "TransferEngine", "WriteOp"]

TRANSPORTS = ("auto", "shm", "tcp", "rdma")

_rdma_logged = False


def _rdma_status() -> RdmaStatus:
    global _rdma_logged
    status = cached_rdma_status()
    if not _rdma_logged:
        _rdma_logged = True
        if status.available:
            log.info("RDMA devices found (%s); RDMA is used only with transport 'rdma' (its "
                     "path is untested on hardware)", status.reason)
        else:
            log.info("RDMA unavailable (%s)", status.reason)
    return status


DEFAULT_IO_TIMEOUT_S = 5.0
"""No progress for this long on a TCP transfer means the peer is gone (partitioned, paused or
dead), not slow: at 100 Mbit/s a full socket buffer (4 MiB) drains in 0.34 s, and TCP's own
retransmission after a loss comes after 0.2 s. Tens of seconds (the old default, `timeout_s`)
held a caller that had nowhere else to read for as long."""


class _NoRdma(Exception):
    """The peer cannot serve RDMA: use TCP for it (internal to the engine)."""


class TransferEngine:
    """Moves bytes between caller buffers and peers' segments. Thread-safe.

    `io_timeout_s` is how long a TCP peer may make no progress (connect, handshake, any one
    send or receive) before the operation fails with `TransferTimeout`; callers with another
    replica to read keep it shorter still (the store client: 1 s, see `TcpTransport`). Its
    default, `DEFAULT_IO_TIMEOUT_S` (or `timeout_s` if shorter), bounds what a partitioned peer
    costs: with the link down nothing answers and nothing resets, and an unbounded socket waits
    out TCP's retransmissions (minutes). Measured on the test bed at 1 Gbit/s, a read from a
    peer whose link went down fails after the io timeout to within 20 ms, on a pooled connection
    and a new one alike, while a healthy 16 MiB read takes 0.15 s.
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
        self._io_timeout = (io_timeout_s if io_timeout_s is not None
                            else min(timeout_s, DEFAULT_IO_TIMEOUT_S))
        if timeout_s <= 0 or self._io_timeout <= 0:
            raise InvalidArgument(f"transfer timeouts must be > 0 s, got timeout_s={timeout_s} "
                                  f"and io_timeout_s={io_timeout_s}")
        self._lock = threading.Lock()
        self._tcp: dict[str, TcpTransport] = {}
        self._shm: dict[str, ShmTransport] = {}
        self._shm_failed: set[str] = set()
        self._rdma_peers: dict[str, Any] = {}  # address -> rdma_verbs.RdmaTransport
        self._rdma_failed: set[str] = set()
        self._closed = False
        self._rdma = _rdma_status()
        self._device: Any = None
        if transport == "rdma":
            # Asked for explicitly: refuse at construction, never fall back silently to TCP.
            # "auto" never selects RDMA: its path is untested on hardware.
            if not self._rdma.available:
                raise InvalidArgument(
                    f"transport 'rdma' asked for but unavailable: {self._rdma.reason}"
                )
            try:
                from mooncake_k8s.transfer.rdma_verbs import open_device

                self._device = open_device()
            except Exception as e:
                raise InvalidArgument(
                    f"transport 'rdma' asked for: {self._rdma.reason}, but the device cannot "
                    f"be opened: {type(e).__name__}: {e}"
                ) from e
            log.warning("transfer engine uses RDMA, as asked; the RDMA transport is UNTESTED "
                        "on hardware (mooncake_transfer_rdma_info says so too)")

    @property
    def io_timeout_s(self) -> float:
        """How long a peer may make no progress before a transfer to it fails."""
        return self._io_timeout

    def rdma_status(self) -> RdmaStatus:
        return self._rdma

    def rdma_state(self) -> str:
        """"unavailable", "untested" or "active" (see `rdma.RDMA_STATES`)."""
        return rdma_state(self._rdma, self.transport)

    def rdma_fallbacks(self) -> int:
        """Peers reached over TCP because they answered that they cannot serve RDMA."""
        return len(self._rdma_failed)

    # -- transports ------------------------------------------------------------------------------

    def _use_shm(self, peer: Peer) -> bool:
        if self.transport == "shm":
            return True
        if self.transport == "tcp":
            return False
        return peer.host_id == self.host_id and peer.address not in self._shm_failed

    def _use_rdma(self, peer: Peer) -> bool:
        return self.transport == "rdma" and peer.address not in self._rdma_failed

    def transport_name(self, peer: Peer) -> str:
        """"shm", "tcp" or "rdma": what the next call to this peer will use."""
        if self._use_rdma(peer):
            return "rdma"
        return "shm" if self._use_shm(peer) else "tcp"

    def _rdma_for(self, peer: Peer) -> Any:
        t = self._rdma_peers.get(peer.address)
        if t is None:
            from mooncake_k8s.transfer.rdma_verbs import RdmaTransport

            control = self._tcp_for(peer)
            with self._lock:
                if self._closed:
                    raise InvalidArgument("transfer engine is closed")
                t = self._rdma_peers.get(peer.address)
                if t is None:
                    t = RdmaTransport(control, self._device,
                                      io_timeout_s=self._io_timeout)
                    self._rdma_peers[peer.address] = t
        return t

    def _rdma_call(self, peer: Peer, ops: Sequence[Any], write: bool,
                   with_checksum: bool) -> list[int] | None:
        """One call over RDMA. Raises `_NoRdma` (after marking the peer) when the peer cannot
        serve RDMA, so the caller goes on over TCP; any other failure drops the queue pair."""
        from mooncake_k8s.transfer.rdma_verbs import RdmaUnsupported

        t = self._rdma_for(peer)
        try:
            sums: list[int] | None = (t.write(ops, with_checksum) if write
                                      else t.read(ops, with_checksum))
            return sums
        except RdmaUnsupported as e:
            with self._lock:
                first = peer.address not in self._rdma_failed
                self._rdma_failed.add(peer.address)
                self._rdma_peers.pop(peer.address, None)
            t.close()
            if first:
                log.warning("peer cannot serve RDMA, using TCP for it: %s", e,
                            extra={"peer": peer.node_id, "address": peer.address})
            raise _NoRdma() from e
        except (TransferRejected, InvalidArgument):  # the request's fault: the QP is fine
            raise
        except Exception:
            with self._lock:  # the next call reconnects
                if self._rdma_peers.get(peer.address) is t:
                    del self._rdma_peers[peer.address]
            t.close()
            raise

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
        if self._use_rdma(peer):
            try:
                return self._rdma_call(peer, ops, False, with_checksum)
            except _NoRdma:
                pass
        elif self._use_shm(peer):
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
        if self._use_rdma(peer):
            try:
                return self._rdma_call(peer, ops, True, with_checksum)
            except _NoRdma:
                pass
        elif self._use_shm(peer):
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
            rdma = self._rdma_peers.pop(peer.address, None)
            self._rdma_failed.discard(peer.address)
        if rdma is not None:
            rdma.close()
        if tcp is not None:
            tcp.close()
        if shm is not None:
            shm.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tcps, self._tcp = list(self._tcp.values()), {}
            shms, self._shm = list(self._shm.values()), {}
            rdmas, self._rdma_peers = list(self._rdma_peers.values()), {}
        for r in rdmas:
            r.close()
        for t in tcps:
            t.close()
        for s in shms:
            s.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
