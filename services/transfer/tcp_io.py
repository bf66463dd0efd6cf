"""Socket plumbing shared by the TCP transfer server and client.

Sockets are blocking with kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO), which avoids
a poll() before every call: a timeout is a limit on one stalled send or receive (no progress
for that long), not on a whole transfer. `Reader` is a small receive buffer in front of a
socket that lets large payloads bypass it, so data lands in its destination without a copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios

SOCK_BUF = 4 << 20
"""SO_SNDBUF / SO_RCVBUF asked for on every transfer socket (the kernel may cap it)."""
RECV_BUF = 16 << 10
"""Per-connection receive buffer for headers and small payloads."""
SMALL = 8 << 10
"""Payloads up to this size are read through the receive buffer (fewer syscalls when many
small responses are pipelined); larger ones go straight into the destination."""
IOV_MAX = 512
SEND_MAX = 1 << 20
"""Bytes per sendmsg call. The kernel holds the socket's lock while one call copies, so ACKs
that arrive meanwhile wait until it returns; one 64 MiB call sends in bursts. Measured on the
test bed (bench/link_bench.py, 2 cores; results/link_bench-before-sendmax.txt is without it):
a single 8 MiB READ at 10 Gbit/s went from 83% to 90% of the link (median call 82% to 93%),
single 8-64 MiB READs unshaped from 1.7-2.0 to 2.8 GB/s; 1 Gbit/s was already at 95%."""
RECV_CHUNK = 1 << 62
"""Cap on one recv of a large payload (releasing the socket lock between pieces lets ACKs flow
sooner). Off: on this loopback VM the measurements were inconclusive; a knob for real NICs."""


class Closed(ConnectionError):
    """The peer closed the connection."""


def timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1_000_000))


def tune(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    sock.settimeout(None)
    tv = timeval(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def sendv(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer, in order, in gathered sendmsg calls of at most SEND_MAX bytes each
    (a larger buffer is cut into views)."""
    total = 0
    for b in bufs:
        total += len(b)
    if total <= SEND_MAX and len(bufs) <= IOV_MAX:  # the common case: one call, no copies
        sent = sock.sendmsg(bufs)
        if sent != total:
            rest = list(bufs)
            del rest[: _advance(rest, 0, sent)]
            _send_batch(sock, rest, total - sent)
        return
    batch: list[bytes | memoryview] = []
    size = 0
    for b in bufs:
        start, n = 0, len(b)
        while start < n:
            take = min(n - start, SEND_MAX - size)
            batch.append(b if take == n else memoryview(b)[start : start + take])
            size += take
            start += take
            if size == SEND_MAX or len(batch) == IOV_MAX:
                _send_batch(sock, batch, size)
                batch, size = [], 0
    if batch:
        _send_batch(sock, batch, size)


def _send_batch(sock: socket.socket, batch: list[bytes | memoryview], total: int) -> None:
    """One gather of `total` bytes, resumed after short sends (`batch` is ours to cut)."""
    sent = sock.sendmsg(batch)
    while sent != total:
        total -= sent
        del batch[: _advance(batch, 0, sent)]
        sent = sock.sendmsg(batch)


def _advance(bufs: list[bytes | memoryview], i: int, sent: int) -> int:
    """After a short send of `sent` bytes from `bufs[i:]`: the index of the first buffer not
    sent whole, that buffer cut to what is left of it."""
    for b in bufs[i:]:
        if sent < len(b):
            bufs[i] = memoryview(b)[sent:]
            break
        sent -= len(b)
        i += 1
    return i


def unsent(sock: socket.socket) -> int:
    """Bytes this side sent that the peer has not acknowledged yet (SIOCOUTQ; 0 if unknown)."""
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", out)[0])


class Reader:
    """A small receive buffer in front of a socket; large payloads bypass it.

    Waiting for an answer after a large write is not a stall while our own bytes are still
    leaving: the send that queued them returned with up to a socket buffer (several MiB) in
    flight, which a slow link drains for longer than the receive timeout (8 MiB at 50 Mbit/s:
    1.3 s). So a receive that times out is retried while the bytes the peer has not yet
    acknowledged keep going down (`unsent`); a stall, which raises, is a whole timeout in which
    none were acknowledged (none in flight included: the peer had everything and said
    nothing)."""

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
        in_flight = -1
        while self.end - start < n:
            try:
                k = recv_into(view[self.end : limit])
            except (BlockingIOError, TimeoutError):
                left = unsent(self.sock)
                if left >= in_flight >= 0 or (in_flight < 0 and not left):
                    raise  # a whole timeout without our bytes moving, or none in flight
                in_flight = left  # still leaving (or just left: the peer gets one timeout)
                continue
            if not k:
                raise Closed("connection closed by peer")
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
                raise Closed("connection closed by peer")
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
