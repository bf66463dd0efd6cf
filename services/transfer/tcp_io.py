"""Socket plumbing shared by the TCP transfer server and client.

Sockets are blocking with kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO), which avoids
a poll() before every call: a timeout is a limit on one stalled send or receive (no progress
for that long), not on a whole transfer. `Reader` is a small receive buffer in front of a
socket that lets large payloads bypass it, so data lands in its destination without a copy.
"""

from __future__ import annotations

import contextlib
import socket
import struct

SOCK_BUF = 4 << 20
"""SO_SNDBUF / SO_RCVBUF asked for on every transfer socket (the kernel may cap it)."""
RECV_BUF = 16 << 10
"""Per-connection receive buffer for headers and small payloads."""
SMALL = 8 << 10
"""Payloads up to this size are read through the receive buffer (fewer syscalls when many
small responses are pipelined); larger ones go straight into the destination."""
IOV_MAX = 512
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
    """Send every buffer, in order, with as few gathered sendmsg calls as possible."""
    n = len(bufs)
    i = 0
    if n <= IOV_MAX:
        total = 0
        for b in bufs:
            total += len(b)
        sent = sock.sendmsg(bufs)
        if sent == total:
            return
        bufs = list(bufs)
        i = _advance(bufs, 0, sent)
    while i < n:
        batch = bufs[i : i + IOV_MAX]
        total = 0
        for b in batch:
            total += len(b)
        sent = sock.sendmsg(batch)
        i = i + len(batch) if sent == total else _advance(bufs, i, sent)


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


class Reader:
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
