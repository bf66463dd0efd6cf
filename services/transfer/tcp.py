"""The TCP transport's client: a lazily connected, pipelining pool of connections to one peer.

Wire format: see `frames`; the server is `tcp_server.TransferServer`; what the client does on a
connection it holds (a pipelined window, the single-op path) is in `tcp_pipe`. The client
`recv_into`s READ payloads straight into the caller's buffer; only bytes that happen to arrive
together with a header (at most the small receive buffer) are copied once from it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence
from typing import NoReturn

from mooncake_k8s.common.checksum import CHUNK, StreamingChecksum
from mooncake_k8s.common.errors import (
    AuthError,
    InvalidArgument,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from mooncake_k8s.common.netutil import split_address
from mooncake_k8s.transfer.frames import (
    HELLO_AUTH_FAILED,
    HELLO_BUSY,
    HELLO_OK,
    HELLO_REPLY,
    MAX_RDMA_ENDPOINT,
    OP_RDMA_CONNECT,
    OP_READ,
    OP_WRITE,
    RDMA_CONNECT_NAME,
    REQ_MAGIC,
    REQUEST,
    RESP_MAGIC,
    RESPONSE,
    ST_OK,
    decode_hello_reply_header,
    decode_response_header,
    encode_hello,
    encode_name,
    encode_request,
)
from mooncake_k8s.transfer.ops import ReadOp, TransferRejected, WriteOp, as_view, check_range
from mooncake_k8s.transfer.tcp_io import SMALL, SOCK_BUF, Closed, Reader, tune
from mooncake_k8s.transfer.tcp_pipe import (
    Conn,
    Sub,
    finish_read,
    receive_hashed,
    send_window,
    send_write,
    start_read,
)
from mooncake_k8s.transfer.tcp_server import TransferServer

__all__ = ["TcpTransport", "TransferServer"]

WINDOW = 128
"""Requests in flight per connection before the client reads their responses."""
SPLIT_MIN = 1 << 62
"""Ops at least this large are split across the connection pool (off: measured no faster
on loopback with two cores; kept as a knob for real NICs)."""
SPREAD_MIN_OPS = 64
"""A batch with at least this many ops, averaging under SPREAD_MAX_AVG bytes, is spread over the
connection pool (measured: helps many 4 KiB ops; one connection is faster for 64 KiB and up)."""
SPREAD_MAX_AVG = 32 << 10


class TcpTransport:
    """Client of one peer's TransferServer: a lazily connected pool of connections.

    Thread-safe: each call checks out the connections it uses. A batch is pipelined (requests
    sent in windows, then responses read in order); large batches spread over the pool.

    Two limits: `io_timeout_s` bounds connecting, the handshake, and every send or receive that
    makes no progress, so a paused or black-holed peer fails fast (`TransferTimeout`) while a
    large transfer that keeps moving is never cut short; `timeout_s` bounds waiting for a free
    connection of the pool, which is contention, not a sick peer.
    """

    def __init__(
        self, address: str, token: str, connections: int = 4, timeout_s: float = 30.0,
        io_timeout_s: float | None = None,
    ) -> None:
        try:
            self._host, self._port = split_address(address)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        if connections < 1:
            raise InvalidArgument("connections must be >= 1")
        if timeout_s <= 0 or (io_timeout_s is not None and io_timeout_s <= 0):
            raise InvalidArgument("transfer timeouts must be > 0 s")
        self.address = address
        self._token = token
        self._hello = encode_hello(token)
        self._timeout = timeout_s
        self._io_timeout = io_timeout_s if io_timeout_s is not None else timeout_s
        self._slots: list[Conn | None] = [None] * connections
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0
        self._names: dict[str, bytes] = {}
        self._closed = False
        self._size = connections

    # -- pool ----------------------------------------------------------------------------------

    def _acquire(self, want: int) -> list[Conn | None]:
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

    def _release(self, conns: list[Conn | None]) -> None:
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

    def _connect(self) -> Conn:
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
                sock.settimeout(self._io_timeout)
                sock.connect(sa)
                tune(sock, self._io_timeout)
                break
            except OSError as e:
                sock.close()
                last = e
        else:
            if isinstance(last, TimeoutError):
                raise TransferTimeout(f"connect to {self.address} timed out") from last
            raise TransferError(f"cannot connect to {self.address}: {last}") from last
        conn = Conn(sock)
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
        if status == HELLO_BUSY:
            raise TransferError(f"transfer peer {self.address} is at its connection limit: {msg}")
        raise ProtocolError(f"transfer peer {self.address} refused the handshake: {msg}")

    def _wrap(self, e: BaseException) -> TransferError:
        if isinstance(e, TransferError):
            return e
        if isinstance(e, (BlockingIOError, TimeoutError)):
            return TransferTimeout(f"transfer to {self.address} timed out")
        if isinstance(e, Closed):
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

    def exchange_rdma(self, endpoint: bytes) -> tuple[socket.socket, bytes]:
        """Send our RDMA endpoint on a new authenticated connection of its own (not pooled)
        and return that connection with the peer's endpoint bytes.

        The peer's queue pair lives as long as the returned socket: the caller keeps it open
        while it uses RDMA and closes it to tear the pair down. Raises `TransferRejected` with
        the peer's status and reason when it refuses (``ST_UNSUPPORTED``: it cannot serve
        RDMA), `AuthError` for a wrong token, `TransferError`/`TransferTimeout` otherwise.
        """
        if len(endpoint) > MAX_RDMA_ENDPOINT:
            raise InvalidArgument(f"RDMA endpoint of {len(endpoint)} bytes over limit")
        conn = self._connect()
        try:
            conn.sock.sendall(
                encode_request(OP_RDMA_CONNECT, RDMA_CONNECT_NAME, 1, 0, len(endpoint))
                + endpoint)
            p = conn.rd.fill(RESPONSE.size, readahead=False)
            status, rid, length = decode_response_header(conn.rd.buf, p)
            conn.rd.start = p + RESPONSE.size
            if rid != 1:
                raise ProtocolError(f"response id {rid} from {self.address}, expected 1")
            if length > MAX_RDMA_ENDPOINT:
                raise ProtocolError(f"RDMA endpoint of {length} bytes from {self.address}")
            body = conn.rd.read_bytes(length)
        except BaseException as e:
            conn.close()
            if isinstance(e, (TransferError, AuthError)):
                raise
            if isinstance(e, OSError):
                raise self._wrap(e) from e
            raise
        if status != ST_OK:
            conn.close()
            raise TransferRejected(
                f"{self.address}: {body.decode('utf-8', 'replace')}", status)
        with contextlib.suppress(OSError):
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return conn.sock, body

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

    def _plan(self, items: list[tuple[bytes, int, memoryview]]) -> tuple[list[Sub], int]:
        subs: list[Sub] = []
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
        conns: list[Conn | None],
        op: int,
        work: tuple[bytes, int, memoryview] | list[Sub],
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
        work: tuple[bytes, int, memoryview] | list[Sub]
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
    def _drop(conns: list[Conn | None]) -> None:
        for i, c in enumerate(conns):
            if c is not None:
                c.close()
                conns[i] = None

    def _exchange(
        self,
        conns: list[Conn | None],
        op: int,
        subs: list[Sub],
        nops: int,
        with_checksum: bool,
    ) -> list[int] | None:
        """A batch pipelined over the connections, one window at a time: the window's requests
        go out round-robin, then its responses are read in the same order. A rejection is
        raised once its window is drained, so every connection stays in step for reuse."""
        for i, c in enumerate(conns):
            if c is None:
                conns[i] = self._connect()
        live: list[Conn] = [c for c in conns if c is not None]
        sums: list[int] | None = [0] * nops if with_checksum else None
        hashers: dict[int, StreamingChecksum] = {}
        window = WINDOW * len(live)
        try:
            for w0 in range(0, len(subs), window):
                win = subs[w0 : w0 + window]
                rids = send_window(live, op, win, sums, hashers)
                rejected = self._receive_window(live, op == OP_WRITE, win, rids, sums, hashers)
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

    def _receive_window(
        self,
        live: list[Conn],
        is_write: bool,
        win: list[Sub],
        rids: list[int],
        sums: list[int] | None,
        hashers: dict[int, StreamingChecksum],
    ) -> TransferRejected | None:
        """Read one window's responses in order: READ payloads land straight in their buffers
        (hashed as they land when asked). Returns the window's first rejection, if any, with
        every rejection's message consumed."""
        nc = len(live)
        rejected: TransferRejected | None = None
        for j, (idx, _name, _off, v, split) in enumerate(win):
            rd = live[j % nc].rd
            n = len(v)
            p = rd.fill(RESPONSE.size, n <= SMALL or is_write)
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
            else:
                receive_hashed(rd, v, idx, split, sums, hashers)
        return rejected

    def _one(
        self, c: Conn, op: int, name: bytes, off: int, v: memoryview, with_checksum: bool
    ) -> list[int] | None:
        """One operation alone on a connection: the latency path, with the fewest syscalls."""
        n = len(v)
        rid = c.rid = (c.rid + 1) & 0xFFFFFFFF
        hdr = REQUEST.pack(REQ_MAGIC, op, len(name), rid, off, n) + name
        rd = c.rd
        total: int | None = None
        already = 0
        if op == OP_READ:
            p, already = start_read(c, hdr, v, with_checksum)
        else:
            total = send_write(c.sock, hdr, v, with_checksum)
            p = rd.fill(RESPONSE.size)
        magic, status, rrid, length = RESPONSE.unpack_from(rd.buf, p)
        if magic != RESP_MAGIC or status != ST_OK or rrid != rid or length != n:
            self._refuse_one(rd, p, rid, v, already)
        rd.start = p + RESPONSE.size
        if op == OP_WRITE:
            return None if total is None else [total]
        return finish_read(rd, v, already, with_checksum)

    def _refuse_one(self, rd: Reader, p: int, rid: int, v: memoryview, already: int) -> NoReturn:
        """A single op's response that is not a plain OK: a `ProtocolError` for a wrong id or
        length, else the peer's rejection with its message."""
        status, rrid, length = decode_response_header(rd.buf, p)
        if rrid != rid:
            raise ProtocolError(f"response id {rrid} from {self.address}, expected {rid}")
        if status == ST_OK:
            raise ProtocolError(
                f"response length {length} from {self.address}, expected {len(v)}")
        rd.start = p + RESPONSE.size
        # Nothing else is in flight here, so a message that went into dst ends there.
        head = bytes(v[: min(already, length)])
        msg = (head + rd.read_bytes(length - len(head))).decode("utf-8", "replace")
        raise TransferRejected(f"{self.address}: {msg}", status)
