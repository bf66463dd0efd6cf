"""The TCP transfer server: serves a process's segments to peers, one thread per connection.

Wire format: see `frames`. The server `recv_into`s WRITE payloads straight into the segment and
sends READ payloads from it with `sendmsg` (header and payload in one gather), so data never
takes an intermediate copy. An idle connection (between frames) never times out; one that stalls
in the middle of a frame is closed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping

from mooncake_k8s.common.auth import token_matches
from mooncake_k8s.common.errors import ProtocolError

from .frames import (
    HELLO,
    HELLO_AUTH_FAILED,
    HELLO_BAD_VERSION,
    HELLO_OK,
    OP_READ,
    OP_WRITE,
    REQ_MAGIC,
    REQUEST,
    RESP_MAGIC,
    RESPONSE,
    ST_OK,
    ST_OUT_OF_RANGE,
    ST_UNKNOWN_SEGMENT,
    VERSION,
    decode_hello_header,
    decode_name,
    decode_request_header,
    encode_error,
    encode_hello_reply,
    encode_name,
)
from .segments import Segment
from .tcp_io import SOCK_BUF, Reader, sendv, tune

log = logging.getLogger(__name__)

FLUSH_BYTES = 256 << 10
FLUSH_IOVS = 256
DRAIN_LIMIT = 64 << 20
"""A rejected WRITE's payload up to this size is read and discarded to keep the connection."""


class TransferServer:
    """Serves segments over TCP: one daemon thread per connection, blocking sockets."""

    def __init__(
        self,
        segments: Mapping[str, Segment],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        *,
        max_connections: int = 256,
        io_timeout_s: float = 30.0,
        on_bytes: Callable[[str, int], None] | None = None,
    ) -> None:
        self._segments: dict[bytes, Segment] = {
            encode_name(name): seg for name, seg in segments.items()
        }
        self._host = host
        self._port = port
        self._token = token
        self._max_connections = max_connections
        self._io_timeout = io_timeout_s
        self._on_bytes = on_bytes
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False

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
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="transfer-accept", daemon=True
        )
        self._accept_thread.start()
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

    def stop(self) -> None:
        self._stopping = True
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
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2)
            self._accept_thread = None

    def __enter__(self) -> TransferServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        lst = self._listener
        assert lst is not None
        while not self._stopping:
            try:
                sock, addr = lst.accept()
            except OSError:
                if self._stopping:
                    return
                time.sleep(0.01)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(sock)
            if full:
                log.warning(
                    "transfer connection refused: too many connections",
                    extra={"peer": peer, "max_connections": self._max_connections},
                )
                sock.close()
                continue
            threading.Thread(
                target=self._serve, args=(sock, peer), name="transfer-conn", daemon=True
            ).start()

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            tune(sock, self._io_timeout)
            rd = Reader(sock)
            if self._handshake(sock, rd, peer):
                self._loop(sock, rd)
        except ProtocolError as e:
            log.warning("closing transfer connection: %s", e, extra={"peer": peer})
        except BlockingIOError:
            log.warning(
                "closing transfer connection: timed out in the middle of a frame",
                extra={"peer": peer},
            )
        except OSError as e:
            if not self._stopping:
                log.debug("transfer connection ended: %s", e, extra={"peer": peer})
        except Exception:
            log.exception("closing transfer connection after an internal error",
                          extra={"peer": peer})
        finally:
            with self._lock:
                self._conns.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _handshake(self, sock: socket.socket, rd: Reader, peer: str) -> bool:
        p = rd.fill(HELLO.size, readahead=False)
        version, tlen = decode_hello_header(rd.buf, p)
        rd.start += HELLO.size
        token = rd.read_bytes(tlen) if tlen else b""
        if version != VERSION:
            sock.sendall(
                encode_hello_reply(HELLO_BAD_VERSION, f"unsupported protocol version {version}")
            )
            log.warning("transfer handshake rejected: protocol version %d", version,
                        extra={"peer": peer})
            return False
        if self._token and not token_matches(self._token, token):
            sock.sendall(encode_hello_reply(HELLO_AUTH_FAILED, "invalid cluster token"))
            log.warning("transfer handshake rejected: invalid cluster token", extra={"peer": peer})
            return False
        sock.sendall(encode_hello_reply(HELLO_OK))
        return True

    def _loop(self, sock: socket.socket, rd: Reader) -> None:
        pending: list[bytes | memoryview] = []
        pending_bytes = 0
        pending_data = False
        on_bytes = self._on_bytes
        unpack = REQUEST.unpack_from
        pack = RESPONSE.pack
        scratch: memoryview | None = None
        hsize = REQUEST.size
        while True:
            if rd.end - rd.start < hsize:
                if pending:
                    sendv(sock, pending)
                    pending.clear()
                    pending_bytes = 0
                    pending_data = False
                try:
                    p = rd.fill(hsize)
                except BlockingIOError:
                    # Idle between frames is fine; a partial header is not.
                    if rd.end != rd.start or self._stopping:
                        raise
                    continue
            else:
                p = rd.start
            magic, op, nlen, rid, off, length = unpack(rd.buf, p)
            if magic != REQ_MAGIC or op not in (OP_READ, OP_WRITE) or not 0 < nlen <= 100:
                decode_request_header(rd.buf, p)  # raises the specific ProtocolError
            if length > 1 << 36 or off > 1 << 48:
                decode_request_header(rd.buf, p)
            p = rd.fill(hsize + nlen)
            key = bytes(rd.view[p + hsize : p + hsize + nlen])
            rd.start = p + hsize + nlen
            seg = self._segments.get(key)
            status = ST_OK
            msg = ""
            if seg is None:
                name = decode_name(key)  # garbage names close the connection
                status, msg = ST_UNKNOWN_SEGMENT, f"unknown segment {name!r}"
            elif off + length > seg.desc.size:
                status = ST_OUT_OF_RANGE
                msg = (f"range [{off}, {off + length}) outside segment {seg.desc.name!r} "
                       f"of {seg.desc.size} bytes")
            if op == OP_READ:
                if status == ST_OK:
                    assert seg is not None
                    pending.append(pack(RESP_MAGIC, ST_OK, rid, length))
                    pending.append(seg.buf[off : off + length])
                    pending_data = True
                    pending_bytes += length
                    if on_bytes is not None:
                        on_bytes("out", length)
                else:
                    pending.append(encode_error(status, rid, msg))
            else:
                if status == ST_OK:
                    assert seg is not None
                    if pending_data:  # a READ queued earlier must see the bytes before this WRITE
                        sendv(sock, pending)
                        pending.clear()
                        pending_bytes = 0
                        pending_data = False
                    rd.read_into(seg.buf[off : off + length])
                    pending.append(pack(RESP_MAGIC, ST_OK, rid, length))
                    if on_bytes is not None:
                        on_bytes("in", length)
                else:
                    if length > DRAIN_LIMIT:
                        raise ProtocolError(f"rejected WRITE of {length} bytes: {msg}")
                    if scratch is None:
                        scratch = memoryview(bytearray(256 << 10))
                    rd.skip(length, scratch)
                    pending.append(encode_error(status, rid, msg))
            if pending_bytes >= FLUSH_BYTES or len(pending) >= FLUSH_IOVS:
                sendv(sock, pending)
                pending.clear()
                pending_bytes = 0
                pending_data = False
