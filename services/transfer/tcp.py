"""TCP transport: a threaded server that serves segments, and a pooled, pipelining client.

Wire format: see `frames`. Data never takes an intermediate copy on the data path: the server
`recv_into`s WRITE payloads straight into the segment and sends READ payloads from it with
`sendmsg` (header and payload in one gather); the client `recv_into`s READ payloads straight into
the caller's buffer. Only bytes that happen to arrive together with a header (at most the small
receive buffer) are copied once from it.

Sockets are blocking with kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO), which avoids
a poll() before every call. An idle server connection (between frames) never times out; one
that stalls in the middle of a frame is closed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from mooncake_k8s.common.auth import token_matches
from mooncake_k8s.common.checksum import CHUNK, StreamingChecksum, checksum
from mooncake_k8s.common.errors import (
    AuthError,
    InvalidArgument,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from mooncake_k8s.common.netutil import split_address

from .frames import (
    HELLO,
    HELLO_AUTH_FAILED,
    HELLO_BAD_VERSION,
    HELLO_OK,
    HELLO_REPLY,
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
    decode_hello_reply_header,
    decode_name,
    decode_request_header,
    decode_response_header,
    encode_error,
    encode_hello,
    encode_hello_reply,
    encode_name,
)
from .ops import ReadOp, TransferRejected, WriteOp, as_view, check_range
from .segments import Segment

log = logging.getLogger(__name__)

SOCK_BUF = 4 << 20
"""SO_SNDBUF / SO_RCVBUF asked for on every transfer socket (the kernel may cap it)."""
RECV_BUF = 16 << 10
"""Per-connection receive buffer for headers and small payloads."""
SMALL = 8 << 10
"""Payloads up to this size are read through the receive buffer (fewer syscalls when many
small responses are pipelined); larger ones go straight into the destination."""
WINDOW = 128
"""Requests in flight per connection before the client reads their responses."""
FLUSH_BYTES = 256 << 10
FLUSH_IOVS = 256
DRAIN_LIMIT = 64 << 20
"""A rejected WRITE's payload up to this size is read and discarded to keep the connection."""
IOV_MAX = 512
RECV_CHUNK = 1 << 62
"""Cap on one recv of a large payload (releasing the socket lock between pieces lets ACKs flow
sooner). Off: on this loopback VM the measurements were inconclusive; a knob for real NICs."""
SPLIT_MIN = 1 << 62
"""Ops at least this large are split across the connection pool (off: measured no faster
on loopback with two cores; kept as a knob for real NICs)."""
SPREAD_MIN_OPS = 64
"""A batch with at least this many ops, averaging under SPREAD_MAX_AVG bytes, is spread over the
connection pool (measured: helps many 4 KiB ops; one connection is faster for 64 KiB and up)."""
SPREAD_MAX_AVG = 32 << 10


class _Closed(ConnectionError):
    pass


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1_000_000))


def _tune(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    sock.settimeout(None)
    tv = _timeval(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _sendv(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer, in order, with as few gathered sendmsg calls as possible."""
    n = len(bufs)
    if n <= IOV_MAX:
        total = 0
        for b in bufs:
            total += len(b)
        sent = sock.sendmsg(bufs)
        if sent == total:
            return
        bufs = list(bufs)
        i = 0
        for b in bufs:
            if sent >= len(b):
                sent -= len(b)
                i += 1
            else:
                bufs[i] = memoryview(b)[sent:]
                break
    else:
        i = 0
    while i < n:
        batch = bufs[i : i + IOV_MAX]
        total = 0
        for b in batch:
            total += len(b)
        sent = sock.sendmsg(batch)
        if sent == total:
            i += len(batch)
            continue
        for b in batch:
            if sent >= len(b):
                sent -= len(b)
                i += 1
            else:
                bufs[i] = memoryview(b)[sent:]
                break


class _Reader:
    """A small receive buffer in front of a socket; large payloads bypass it."""

    __slots__ = ("buf", "end", "sock", "start", "view")

    def __init__(self, sock: socket.socket, size: int = RECV_BUF) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def fill(self, n: int, readahead: bool = True) -> int:
        """Make `n` bytes available at `start`; return `start`."""
        start = self.start
        if self.end - start >= n:
            return start
        if start + n > len(self.buf):
            avail = self.end - start
            if avail:
                self.view[:avail] = self.view[start : self.end]
            self.start = start = 0
            self.end = avail
        limit = len(self.buf) if readahead else start + n
        view = self.view
        recv_into = self.sock.recv_into
        while self.end - start < n:
            k = recv_into(view[self.end : limit])
            if not k:
                raise _Closed("connection closed by peer")
            self.end += k
        return start

    def read_into(self, dst: memoryview) -> None:
        """Fill `dst` exactly: buffered bytes first, then straight from the socket."""
        n = len(dst)
        avail = self.end - self.start
        if avail:
            k = avail if avail < n else n
            dst[:k] = self.view[self.start : self.start + k]
            self.start += k
            if k == n:
                return
        else:
            k = 0
        recv_into = self.sock.recv_into
        step = RECV_CHUNK
        while k < n:
            got = recv_into(dst[k : k + step])
            if not got:
                raise _Closed("connection closed by peer")
            k += got

    def read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int, scratch: memoryview) -> None:
        while n:
            k = min(n, len(scratch))
            self.read_into(scratch[:k])
            n -= k


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------


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
            _tune(sock, self._io_timeout)
            rd = _Reader(sock)
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

    def _handshake(self, sock: socket.socket, rd: _Reader, peer: str) -> bool:
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

    def _loop(self, sock: socket.socket, rd: _Reader) -> None:
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
                    _sendv(sock, pending)
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
                        _sendv(sock, pending)
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
                _sendv(sock, pending)
                pending.clear()
                pending_bytes = 0
                pending_data = False


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------


class _Conn:
    __slots__ = ("rd", "reused", "rid", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rd = _Reader(sock)
        self.rid = 0
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# One planned piece of an operation: (op index, name, offset, view, split)
_Sub = tuple[int, bytes, int, memoryview, bool]


class TcpTransport:
    """Client of one peer's TransferServer: a lazily connected pool of connections.

    Thread-safe: each call checks out the connections it uses. A batch is pipelined (requests
    sent in windows, then responses read in order); large batches spread over the pool.
    """

    def __init__(
        self, address: str, token: str, connections: int = 4, timeout_s: float = 30.0
    ) -> None:
        try:
            self._host, self._port = split_address(address)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        if connections < 1:
            raise InvalidArgument("connections must be >= 1")
        self.address = address
        self._token = token
        self._hello = encode_hello(token)
        self._timeout = timeout_s
        self._slots: list[_Conn | None] = [None] * connections
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0
        self._names: dict[str, bytes] = {}
        self._closed = False
        self._size = connections

    # -- pool ----------------------------------------------------------------------------------

    def _acquire(self, want: int) -> list[_Conn | None]:
        with self._lock:
            slots = self._slots
            if slots and not self._closed:
                got = [slots.pop()]
                while len(got) < want and slots:
                    got.append(slots.pop())
                return got
        with self._cond:
            self._waiters += 1
            try:
                ok = self._cond.wait_for(lambda: bool(self._slots) or self._closed, self._timeout)
            finally:
                self._waiters -= 1
            if self._closed:
                raise TransferError(f"transport to {self.address} is closed")
            if not ok:
                raise TransferTimeout(f"no free connection to {self.address}")
            got = [self._slots.pop()]
            while len(got) < want and self._slots:
                got.append(self._slots.pop())
            return got

    def _release(self, conns: list[_Conn | None]) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                for c in conns:
                    if c is None:
                        self._slots.insert(0, None)
                    else:
                        c.reused = True
                        self._slots.append(c)
                if self._waiters:
                    self._cond.notify_all()
        if closed:
            for c in conns:
                if c is not None:
                    c.close()

    def _connect(self) -> _Conn:
        try:
            infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise TransferError(f"cannot resolve {self.address}: {e}") from e
        last: Exception | None = None
        for family, stype, proto, _, sa in infos:
            sock = socket.socket(family, stype, proto)
            try:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
                sock.settimeout(self._timeout)
                sock.connect(sa)
                _tune(sock, self._timeout)
                break
            except OSError as e:
                sock.close()
                last = e
        else:
            if isinstance(last, TimeoutError):
                raise TransferTimeout(f"connect to {self.address} timed out") from last
            raise TransferError(f"cannot connect to {self.address}: {last}") from last
        conn = _Conn(sock)
        try:
            sock.sendall(self._hello)
            p = conn.rd.fill(HELLO_REPLY.size, readahead=False)
            status, mlen = decode_hello_reply_header(conn.rd.buf, p)
            conn.rd.start += HELLO_REPLY.size
            msg = conn.rd.read_bytes(mlen).decode("utf-8", "replace") if mlen else ""
        except BaseException as e:
            conn.close()
            if isinstance(e, ProtocolError):
                raise
            raise self._wrap(e) from e
        if status == HELLO_OK:
            return conn
        conn.close()
        if status == HELLO_AUTH_FAILED:
            raise AuthError(f"transfer peer {self.address} rejected the cluster token")
        raise ProtocolError(f"transfer peer {self.address} refused the handshake: {msg}")

    def _wrap(self, e: BaseException) -> TransferError:
        if isinstance(e, TransferError):
            return e
        if isinstance(e, (BlockingIOError, TimeoutError)):
            return TransferTimeout(f"transfer to {self.address} timed out")
        if isinstance(e, _Closed):
            return TransferError(f"connection to {self.address} closed by peer")
        return TransferError(f"transfer to {self.address} failed: {e}")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            slots, self._slots = self._slots, []
            self._cond.notify_all()
        for c in slots:
            if c is not None:
                c.close()

    # -- public API ----------------------------------------------------------------------------

    def _name(self, name: str) -> bytes:
        b = self._names.get(name)
        if b is None:
            b = self._names[name] = encode_name(name)
        return b

    def read(self, ops: Sequence[ReadOp], with_checksum: bool = False) -> list[int] | None:
        if len(ops) == 1:
            op = ops[0]
            v = as_view(op.dst, True)
            check_range(op.segment, op.offset, len(v))
            return self._run(OP_READ, (self._name(op.segment.name), op.offset, v), with_checksum)
        items: list[tuple[bytes, int, memoryview]] = []
        for op in ops:
            v = as_view(op.dst, True)
            check_range(op.segment, op.offset, len(v))
            items.append((self._name(op.segment.name), op.offset, v))
        return self._run(OP_READ, items, with_checksum)

    def write(self, ops: Sequence[WriteOp], with_checksum: bool = False) -> list[int] | None:
        if len(ops) == 1:
            wop = ops[0]
            v = as_view(wop.src, False)
            check_range(wop.segment, wop.offset, len(v))
            return self._run(
                OP_WRITE, (self._name(wop.segment.name), wop.offset, v), with_checksum
            )
        items: list[tuple[bytes, int, memoryview]] = []
        for wop in ops:
            v = as_view(wop.src, False)
            check_range(wop.segment, wop.offset, len(v))
            items.append((self._name(wop.segment.name), wop.offset, v))
        return self._run(OP_WRITE, items, with_checksum)

    # -- engine --------------------------------------------------------------------------------

    def _plan(self, items: list[tuple[bytes, int, memoryview]]) -> tuple[list[_Sub], int]:
        subs: list[_Sub] = []
        total = 0
        for i, (name, off, v) in enumerate(items):
            n = len(v)
            total += n
            if n >= SPLIT_MIN and self._size > 1:
                piece = -(-n // self._size)
                piece = -(-piece // CHUNK) * CHUNK
                for s in range(0, n, piece):
                    subs.append((i, name, off + s, v[s : s + piece], True))
            else:
                subs.append((i, name, off, v, False))
        want = 1
        many_small = len(subs) >= SPREAD_MIN_OPS and total < SPREAD_MAX_AVG * len(subs)
        if many_small or len(subs) > len(items):
            want = min(self._size, len(subs))
        return subs, want

    def _go(
        self,
        conns: list[_Conn | None],
        op: int,
        work: tuple[bytes, int, memoryview] | list[_Sub],
        nops: int,
        with_checksum: bool,
    ) -> list[int] | None:
        if isinstance(work, list):
            return self._exchange(conns, op, work, nops, with_checksum)
        c = conns[0]
        if c is None:
            c = conns[0] = self._connect()
        try:
            return self._one(c, op, work[0], work[1], work[2], with_checksum)
        except (TransferError, AuthError):
            raise
        except OSError as e:
            raise self._wrap(e) from e

    def _run(
        self,
        op: int,
        items: tuple[bytes, int, memoryview] | list[tuple[bytes, int, memoryview]],
        with_checksum: bool,
    ) -> list[int] | None:
        work: tuple[bytes, int, memoryview] | list[_Sub]
        if isinstance(items, tuple):
            work, want, nops = items, 1, 1
        elif not items:
            return [] if with_checksum else None
        else:
            work, want = self._plan(items)
            nops = len(items)
        conns = self._acquire(want)
        try:
            try:
                return self._go(conns, op, work, nops, with_checksum)
            except TransferRejected:
                raise
            except (AuthError, ProtocolError, TransferTimeout):
                self._drop(conns)
                raise
            except TransferError:
                stale = all(c is not None and c.reused for c in conns)
                self._drop(conns)
                if not stale:
                    raise
            # A pooled connection the peer had closed (restart, idle reap): retry once, fresh.
            return self._go(conns, op, work, nops, with_checksum)
        except TransferRejected:
            raise
        except BaseException:
            self._drop(conns)
            raise
        finally:
            self._release(conns)

    @staticmethod
    def _drop(conns: list[_Conn | None]) -> None:
        for i, c in enumerate(conns):
            if c is not None:
                c.close()
                conns[i] = None

    def _exchange(
        self,
        conns: list[_Conn | None],
        op: int,
        subs: list[_Sub],
        nops: int,
        with_checksum: bool,
    ) -> list[int] | None:
        for i, c in enumerate(conns):
            if c is None:
                conns[i] = self._connect()
        live: list[_Conn] = [c for c in conns if c is not None]
        nc = len(live)
        sums: list[int] | None = [0] * nops if with_checksum else None
        hashers: dict[int, StreamingChecksum] = {}
        rejected: TransferRejected | None = None
        window = WINDOW * nc
        pack = REQUEST.pack
        is_write = op == OP_WRITE
        try:
            for w0 in range(0, len(subs), window):
                win = subs[w0 : w0 + window]
                rids: list[int] = []
                iovs: list[list[bytes | memoryview]] = [[] for _ in range(nc)]
                # -- send ------------------------------------------------------------------
                for j, (idx, name, off, v, split) in enumerate(win):
                    ci = j % nc
                    c = live[ci]
                    rid = c.rid = (c.rid + 1) & 0xFFFFFFFF
                    rids.append(rid)
                    n = len(v)
                    hdr = pack(REQ_MAGIC, op, len(name), rid, off, n) + name
                    if not is_write:
                        iovs[ci].append(hdr)
                        continue
                    if sums is None:
                        iovs[ci] += (hdr, v)
                        continue
                    if n <= CHUNK:
                        if split:
                            hashers.setdefault(idx, StreamingChecksum()).update(v)
                        else:
                            sums[idx] = checksum(v)
                        iovs[ci] += (hdr, v)
                        continue
                    # Large WRITE with checksum: hash each chunk right after sending it.
                    iov = iovs[ci]
                    iov.append(hdr)
                    _sendv(c.sock, iov)
                    iov.clear()
                    h = hashers.setdefault(idx, StreamingChecksum())
                    send = c.sock.sendall
                    for s in range(0, n, CHUNK):
                        chunk = v[s : s + CHUNK]
                        send(chunk)
                        h.update(chunk)
                for ci in range(nc):
                    if iovs[ci]:
                        _sendv(live[ci].sock, iovs[ci])
                # -- receive ---------------------------------------------------------------
                for j, (idx, _name, _off, v, split) in enumerate(win):
                    c = live[j % nc]
                    rd = c.rd
                    n = len(v)
                    small = n <= SMALL
                    p = rd.fill(RESPONSE.size, small or is_write)
                    magic, status, rid, length = RESPONSE.unpack_from(rd.buf, p)
                    if magic != RESP_MAGIC or rid != rids[j]:
                        if magic == RESP_MAGIC:
                            raise ProtocolError(
                                f"response id {rid} from {self.address}, expected {rids[j]}"
                            )
                        decode_response_header(rd.buf, p)
                    if status != ST_OK:
                        status, rid, length = decode_response_header(rd.buf, p)
                        rd.start = p + RESPONSE.size
                        msg = rd.read_bytes(length).decode("utf-8", "replace")
                        if rejected is None:
                            rejected = TransferRejected(f"{self.address}: {msg}", status)
                        continue
                    if length != n:
                        raise ProtocolError(
                            f"response length {length} from {self.address}, expected {n}"
                        )
                    rd.start = p + RESPONSE.size
                    if is_write:
                        continue
                    if sums is None:
                        rd.read_into(v)
                    elif n <= CHUNK and not split:
                        rd.read_into(v)
                        sums[idx] = checksum(v)
                    else:
                        h = hashers.setdefault(idx, StreamingChecksum())
                        for s in range(0, n, CHUNK):
                            chunk = v[s : s + CHUNK]
                            rd.read_into(chunk)
                            h.update(chunk)
                if rejected is not None:
                    raise rejected
        except (TransferError, AuthError):
            raise
        except OSError as e:
            raise self._wrap(e) from e
        if sums is not None:
            for idx, h in hashers.items():
                sums[idx] = h.digest()
        return sums

    def _one(
        self, c: _Conn, op: int, name: bytes, off: int, v: memoryview, with_checksum: bool
    ) -> list[int] | None:
        """One operation alone on a connection: the latency path, with the fewest syscalls."""
        n = len(v)
        rid = c.rid = (c.rid + 1) & 0xFFFFFFFF
        hdr = REQUEST.pack(REQ_MAGIC, op, len(name), rid, off, n) + name
        sock = c.sock
        rd = c.rd
        hsize = RESPONSE.size
        total: int | None = None
        already = 0
        if op == OP_READ:
            sock.sendall(hdr)
            if n > SMALL and rd.start == rd.end:
                # Header into the receive buffer and payload straight into dst: one syscall.
                first = v[: CHUNK if with_checksum else RECV_CHUNK]
                got = sock.recvmsg_into([rd.view[:hsize], first])[0]
                if not got:
                    raise _Closed("connection closed by peer")
                rd.start = 0
                rd.end = got if got < hsize else hsize
                already = got - hsize if got > hsize else 0
                p = rd.fill(hsize, False)
            else:
                p = rd.fill(hsize, n <= SMALL)
        else:
            if with_checksum and n > CHUNK:
                sock.sendall(hdr)
                h = StreamingChecksum()
                for s in range(0, n, CHUNK):
                    chunk = v[s : s + CHUNK]
                    sock.sendall(chunk)
                    h.update(chunk)
                total = h.digest()
            else:
                if with_checksum:
                    total = checksum(v)
                _sendv(sock, [hdr, v])
            p = rd.fill(hsize)
        magic, status, rrid, length = RESPONSE.unpack_from(rd.buf, p)
        if magic != RESP_MAGIC or status != ST_OK or rrid != rid or length != n:
            status, rrid, length = decode_response_header(rd.buf, p)
            if rrid != rid:
                raise ProtocolError(f"response id {rrid} from {self.address}, expected {rid}")
            if status == ST_OK:
                raise ProtocolError(f"response length {length} from {self.address}, expected {n}")
            rd.start = p + hsize
            # Nothing else is in flight here, so a message that went into dst ends there.
            head = bytes(v[: min(already, length)])
            msg = (head + rd.read_bytes(length - len(head))).decode("utf-8", "replace")
            raise TransferRejected(f"{self.address}: {msg}", status)
        rd.start = p + hsize
        if op == OP_WRITE:
            return None if total is None else [total]
        if not with_checksum:
            if already < n:
                rd.read_into(v[already:])
            return None
        if n <= CHUNK:
            if already < n:
                rd.read_into(v[already:])
            return [checksum(v)]
        h = StreamingChecksum()
        for s in range(0, n, CHUNK):
            e = s + CHUNK if s + CHUNK < n else n
            if e > already:
                rd.read_into(v[max(s, already) : e])
            h.update(v[s:e])
        return [h.digest()]
