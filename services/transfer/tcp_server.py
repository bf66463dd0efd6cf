"""The TCP transfer server: serves a process's segments to peers, one thread per connection.

Wire format: see `frames`. The server `recv_into`s WRITE payloads straight into the segment and
sends READ payloads from it with `sendmsg` (header and payload in one gather), so data never
takes an intermediate copy.

Connections are accepted and authenticated by `admission.FrontDoor` on one thread, with a small
budget and a deadline of their own; only authenticated connections get a serving thread and
count against `max_connections`. A served connection that stalls in the middle of a frame for
`io_timeout_s` is closed, and so is one idle between frames for `idle_timeout_s`.

RDMA connect (see `frames`): answered on the connection that asked, by `rdma_verbs`'s
responder, opened on the first such request and only when this host has an RDMA device and
pyverbs; otherwise the answer is ``ST_UNSUPPORTED`` with the reason. The server never selects
RDMA itself, it only answers a client that asked. The queue pair belongs to the connection:
such a connection is exempt from the idle limit (its traffic goes over RDMA, not this socket)
and the pair is destroyed when the connection ends. The RDMA path is untested on hardware.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from mooncake_k8s.common.errors import ProtocolError
from mooncake_k8s.transfer.admission import FrontDoor
from mooncake_k8s.transfer.frames import (
    OP_RDMA_CONNECT,
    OP_READ,
    OP_WRITE,
    REQ_MAGIC,
    REQUEST,
    RESP_MAGIC,
    RESPONSE,
    ST_BAD_REQUEST,
    ST_OK,
    ST_OUT_OF_RANGE,
    ST_UNKNOWN_SEGMENT,
    ST_UNSUPPORTED,
    decode_name,
    decode_rdma_endpoint,
    decode_request_header,
    encode_error,
    encode_name,
    encode_rdma_endpoint,
)
from mooncake_k8s.transfer.rdma import cached_rdma_status
from mooncake_k8s.transfer.segments import Segment
from mooncake_k8s.transfer.tcp_io import SOCK_BUF, Reader, sendv, tune

log = logging.getLogger(__name__)


class _Idle(Exception):
    """A served connection sent nothing for `idle_timeout_s`."""

FLUSH_BYTES = 256 << 10
FLUSH_IOVS = 256
DRAIN_LIMIT = 64 << 20
"""A rejected WRITE's payload up to this size is read and discarded to keep the connection."""


class TransferServer:
    """Serves segments over TCP: one daemon thread per authenticated connection.

    `max_connections` bounds authenticated connections; `max_handshakes` and
    `handshake_timeout_s` bound the ones still authenticating (see `admission`);
    `on_event(kind)` counts front-door outcomes ("accepted", "authenticated", "evicted",
    "timed_out", "rejected", "busy") for metrics. `rdma=False` answers every RDMA connect
    with ``ST_UNSUPPORTED`` even where a device exists.
    """

    def __init__(
        self,
        segments: Mapping[str, Segment],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        *,
        max_connections: int = 256,
        max_handshakes: int = 64,
        handshake_timeout_s: float = 3.0,
        io_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        on_bytes: Callable[[str, int], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        rdma: bool = True,
    ) -> None:
        if max_connections < 1 or max_handshakes < 1:
            raise ValueError("max_connections and max_handshakes must be >= 1")
        if min(handshake_timeout_s, io_timeout_s, idle_timeout_s) <= 0:
            raise ValueError("transfer server timeouts must be > 0 s")
        self._segments: dict[bytes, Segment] = {
            encode_name(name): seg for name, seg in segments.items()
        }
        self._host = host
        self._port = port
        self._token = token
        self._max_connections = max_connections
        self._max_handshakes = max_handshakes
        self._handshake_timeout = handshake_timeout_s
        self._io_timeout = io_timeout_s
        self._idle_timeout = idle_timeout_s
        self._on_bytes = on_bytes
        self._on_event = on_event
        self._listener: socket.socket | None = None
        self._door: FrontDoor | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._rdma_allowed = rdma
        self._rdma_lock = threading.Lock()
        self._rdma: Any = None  # rdma_verbs.RdmaResponder, opened on the first RDMA connect
        self._rdma_problem = ""

    # -- segments ------------------------------------------------------------------------------

    def add_segment(self, segment: Segment) -> None:
        key = encode_name(segment.desc.name)
        with self._lock:
            segs = dict(self._segments)
            segs[key] = segment
            self._segments = segs

    def remove_segment(self, name: str) -> Segment | None:
        key = name.encode()
        with self._lock:
            segs = dict(self._segments)
            seg = segs.pop(key, None)
            self._segments = segs
            responder = self._rdma
        if responder is not None:
            responder.forget(name)
        return seg

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._listener is not None:
            raise RuntimeError("server already started")
        infos = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, stype, proto, _, sockaddr = infos[0]
        lst = socket.socket(family, stype, proto)
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with contextlib.suppress(OSError):
                lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
                lst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
            lst.bind(sockaddr)
            lst.listen(512)
        except OSError:
            lst.close()
            raise
        self._listener = lst
        self._door = FrontDoor(
            lst, self._token, self._admit, max_pending=self._max_handshakes,
            handshake_timeout_s=self._handshake_timeout, on_event=self._on_event,
        )
        self._door.start()
        log.info("transfer server listening", extra={"address": self.address})

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("server not started")
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return int(self._listener.getsockname()[1])

    @property
    def connections(self) -> int:
        """Authenticated connections being served."""
        return len(self._conns)

    @property
    def handshakes(self) -> int:
        """Connections still authenticating."""
        return self._door.pending if self._door is not None else 0

    def stop(self) -> None:
        self._stopping = True
        door, self._door = self._door, None
        if door is not None:
            door.stop()
        lst, self._listener = self._listener, None
        if lst is not None:
            with contextlib.suppress(OSError):
                lst.shutdown(socket.SHUT_RDWR)
            lst.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._rdma_lock:
            responder, self._rdma = self._rdma, None
        if responder is not None:
            responder.close()

    def __enter__(self) -> TransferServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _admit(self, sock: socket.socket, peer: str) -> bool:
        """Take an authenticated connection from the front door, within `max_connections`."""
        with self._lock:
            if self._stopping or len(self._conns) >= self._max_connections:
                return False
            self._conns.add(sock)
        door = self._door
        if door is None or not door.send_ok(sock):
            self._release(sock)
            return True
        threading.Thread(
            target=self._serve, args=(sock, peer), name="transfer-conn", daemon=True
        ).start()
        return True

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        held: list[Any] = []  # this connection's RDMA queue pair, if it asked for one
        try:
            sock.setblocking(True)
            tune(sock, min(self._io_timeout, self._idle_timeout))
            self._loop(sock, Reader(sock), peer, held)
        except ProtocolError as e:
            log.warning("closing transfer connection: %s", e, extra={"peer": peer})
        except BlockingIOError:
            log.warning(
                "closing transfer connection: timed out in the middle of a frame",
                extra={"peer": peer},
            )
        except _Idle:
            log.debug("closing idle transfer connection", extra={"peer": peer})
        except OSError as e:
            if not self._stopping:
                log.debug("transfer connection ended: %s", e, extra={"peer": peer})
        except Exception:
            log.exception("closing transfer connection after an internal error",
                          extra={"peer": peer})
        finally:
            for qp in held:
                qp.close()
            self._release(sock)

    # -- RDMA connect --------------------------------------------------------------------------

    def _responder(self) -> tuple[Any, str]:
        """(responder, "") or (None, why this server cannot serve RDMA)."""
        with self._rdma_lock:
            if self._rdma is not None or self._rdma_problem:
                return self._rdma, self._rdma_problem
            if not self._rdma_allowed:
                self._rdma_problem = "RDMA is disabled on this transfer server"
                return None, self._rdma_problem
            status = cached_rdma_status()
            if not status.available:
                self._rdma_problem = status.reason
                return None, status.reason
            try:
                from mooncake_k8s.transfer.rdma_verbs import RdmaResponder, open_device

                self._rdma = RdmaResponder(open_device())
            except Exception as e:  # pyverbs errors, or no usable port
                self._rdma_problem = f"cannot open the RDMA device: {type(e).__name__}: {e}"
                log.warning("transfer server: %s", self._rdma_problem)
            return self._rdma, self._rdma_problem

    def _rdma_connect(self, sock: socket.socket, rid: int, payload: bytes, peer: str,
                      held: list[Any]) -> bytes:
        """The response to one RDMA connect (an error status keeps the connection)."""
        client = decode_rdma_endpoint(payload)  # malformed: ProtocolError closes the connection
        if held:
            return encode_error(ST_BAD_REQUEST, rid, "this connection already has an RDMA "
                                "queue pair; open another connection for another")
        responder, problem = self._responder()
        if responder is None:
            return encode_error(ST_UNSUPPORTED, rid, f"RDMA unavailable at the peer: {problem}")
        try:
            local, served = responder.accept(client, self._segments)
        except Exception as e:
            log.warning("RDMA connect failed: %s", e, extra={"peer": peer})
            return encode_error(ST_UNSUPPORTED, rid, f"RDMA setup failed at the peer: "
                                f"{type(e).__name__}: {e}")
        held.append(served)
        try:
            body = encode_rdma_endpoint(local)
        except ValueError as e:  # more or larger regions than one endpoint may carry
            return encode_error(ST_UNSUPPORTED, rid, f"RDMA setup failed at the peer: {e}")
        # Its traffic now bypasses this socket: keepalives notice a peer that vanished.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        log.info("RDMA queue pair served (untested on hardware)",
                 extra={"peer": peer, "regions": len(local.regions)})
        return RESPONSE.pack(RESP_MAGIC, ST_OK, rid, len(body)) + body

    def _loop(self, sock: socket.socket, rd: Reader, peer: str, held: list[Any]) -> None:
        """Serve requests until the peer closes or idles out: READs answered from the segment,
        WRITEs received into it, replies gathered (`_Replies`) and sent when the client waits
        for them (no whole header buffered) or enough has piled up."""
        out = _Replies(sock)
        unpack = REQUEST.unpack_from
        hsize = REQUEST.size
        while True:
            if rd.end - rd.start < hsize:
                out.flush()
                p = self._next_header(rd, held)
            else:
                p = rd.start
            magic, op, nlen, rid, off, length = unpack(rd.buf, p)
            if magic != REQ_MAGIC or op not in (OP_READ, OP_WRITE) or not 0 < nlen <= 100:
                decode_request_header(rd.buf, p)  # raises the specific ProtocolError
                if op == OP_RDMA_CONNECT:  # rare, once per RDMA peer: off the fast path
                    p = rd.fill(hsize + nlen)
                    rd.start = p + hsize + nlen
                    payload = rd.read_bytes(length)
                    out.iov.append(self._rdma_connect(sock, rid, payload, peer, held))
                    continue
            if length > 1 << 36 or off > 1 << 48:
                decode_request_header(rd.buf, p)
            p = rd.fill(hsize + nlen)
            key = bytes(rd.view[p + hsize : p + hsize + nlen])
            rd.start = p + hsize + nlen
            seg, status, msg = self._lookup(key, off, length)
            if op == OP_READ:
                self._serve_read(out, seg, status, msg, rid, off, length)
            else:
                self._serve_write(out, rd, seg, status, msg, rid, off, length)
            if out.nbytes >= FLUSH_BYTES or len(out.iov) >= FLUSH_IOVS:
                out.flush()

    def _next_header(self, rd: Reader, held: list[Any]) -> int:
        """Wait for the next request header and return its position. Idle between frames is
        fine for `idle_timeout_s` (forever while an RDMA pair is held); a partial header is
        not."""
        waiting = time.monotonic()
        while True:
            try:
                return rd.fill(REQUEST.size)
            except BlockingIOError:
                if rd.end != rd.start or self._stopping:
                    raise
                if time.monotonic() - waiting >= self._idle_timeout and not held:
                    raise _Idle() from None

    def _lookup(self, key: bytes, off: int, length: int) -> tuple[Segment | None, int, str]:
        """The segment a request names and whether its range fits: (segment, ST_OK, "") or
        (None, error status, message). A name that is not text closes the connection."""
        seg = self._segments.get(key)
        if seg is None:
            name = decode_name(key)
            return None, ST_UNKNOWN_SEGMENT, f"unknown segment {name!r}"
        if off + length > seg.desc.size:
            return None, ST_OUT_OF_RANGE, (f"range [{off}, {off + length}) outside segment "
                                           f"{seg.desc.name!r} of {seg.desc.size} bytes")
        return seg, ST_OK, ""

    def _serve_read(self, out: _Replies, seg: Segment | None, status: int, msg: str, rid: int,
                    off: int, length: int) -> None:
        """Queue a READ's reply: the header and the segment's bytes themselves (no copy)."""
        if seg is None:
            out.iov.append(encode_error(status, rid, msg))
            return
        out.iov.append(RESPONSE.pack(RESP_MAGIC, ST_OK, rid, length))
        out.iov.append(seg.buf[off : off + length])
        out.data = True
        out.nbytes += length
        if self._on_bytes is not None:
            self._on_bytes("out", length)

    def _serve_write(self, out: _Replies, rd: Reader, seg: Segment | None, status: int,
                     msg: str, rid: int, off: int, length: int) -> None:
        """Receive a WRITE's payload into the segment and queue its reply; a rejected one's
        payload is read and dropped (up to DRAIN_LIMIT) so the connection stays usable."""
        if seg is None:
            if length > DRAIN_LIMIT:
                raise ProtocolError(f"rejected WRITE of {length} bytes: {msg}")
            rd.skip(length, out.scratch())
            out.iov.append(encode_error(status, rid, msg))
            return
        if out.data:  # a READ queued earlier must see the bytes before this WRITE
            out.flush()
        rd.read_into(seg.buf[off : off + length])
        out.iov.append(RESPONSE.pack(RESP_MAGIC, ST_OK, rid, length))
        if self._on_bytes is not None:
            self._on_bytes("in", length)


class _Replies:
    """The replies queued on one served connection, sent in one gather by `flush`."""

    __slots__ = ("_scratch", "data", "iov", "nbytes", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.iov: list[bytes | memoryview] = []
        self.nbytes = 0
        # A READ's segment bytes are queued: a WRITE must not change them before they go.
        self.data = False
        self._scratch: memoryview | None = None

    def flush(self) -> None:
        if self.iov:
            sendv(self.sock, self.iov)
            self.iov.clear()
            self.nbytes = 0
            self.data = False

    def scratch(self) -> memoryview:
        """Where a rejected WRITE's payload is read to be dropped (allocated on first use)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(256 << 10))
        return self._scratch
