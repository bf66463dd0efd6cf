"""What the TCP transfer client does on connections it already holds: a pipelined window of
requests and its responses, and the single-op latency path.

Split from `tcp` (the pool, the handshake, planning and error mapping) so each function here
is one step a reader can follow alone. Everything here raises what the socket raises (`OSError`,
`Closed`); the caller maps that to the transfer errors.
"""

from __future__ import annotations

import contextlib
import socket

from mooncake_k8s.common.checksum import CHUNK, StreamingChecksum, checksum
from mooncake_k8s.transfer.frames import OP_WRITE, REQ_MAGIC, REQUEST, RESPONSE
from mooncake_k8s.transfer.tcp_io import RECV_CHUNK, SMALL, Closed, Reader, sendv


class Conn:
    """One pooled connection: its socket, receive buffer and last request id."""

    __slots__ = ("rd", "reused", "rid", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rd = Reader(sock)
        self.rid = 0
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


Sub = tuple[int, bytes, int, memoryview, bool]
"""One planned piece of an operation: (op index, name, offset, view, split)."""


def send_window(
    live: list[Conn],
    op: int,
    win: list[Sub],
    sums: list[int] | None,
    hashers: dict[int, StreamingChecksum],
) -> list[int]:
    """Send one window's requests round-robin over `live` and return their ids. WRITE payloads
    go with their headers, checksummed as they leave when asked (a large one chunk by chunk,
    each hashed right after it is sent)."""
    nc = len(live)
    pack = REQUEST.pack
    is_write = op == OP_WRITE
    rids: list[int] = []
    iovs: list[list[bytes | memoryview]] = [[] for _ in range(nc)]
    for j, (idx, name, off, v, split) in enumerate(win):
        ci = j % nc
        c = live[ci]
        rid = c.rid = (c.rid + 1) & 0xFFFFFFFF
        rids.append(rid)
        n = len(v)
        hdr = pack(REQ_MAGIC, op, len(name), rid, off, n) + name
        if not is_write:
            iovs[ci].append(hdr)
        elif sums is None:
            iovs[ci] += (hdr, v)
        elif n <= CHUNK:
            if split:
                hashers.setdefault(idx, StreamingChecksum()).update(v)
            else:
                sums[idx] = checksum(v)
            iovs[ci] += (hdr, v)
        else:
            iov = iovs[ci]
            iov.append(hdr)
            sendv(c.sock, iov)
            iov.clear()
            _send_hashed(c.sock, v, hashers.setdefault(idx, StreamingChecksum()))
    for ci in range(nc):
        if iovs[ci]:
            sendv(live[ci].sock, iovs[ci])
    return rids


def _send_hashed(sock: socket.socket, v: memoryview, h: StreamingChecksum) -> None:
    """A payload chunk by chunk, each hashed while the next one is not yet needed."""
    send = sock.sendall
    for s in range(0, len(v), CHUNK):
        chunk = v[s : s + CHUNK]
        send(chunk)
        h.update(chunk)


def receive_hashed(
    rd: Reader,
    v: memoryview,
    idx: int,
    split: bool,
    sums: list[int],
    hashers: dict[int, StreamingChecksum],
) -> None:
    """A READ payload into `v` with its checksum: whole for a small op of its own, else chunk by
    chunk into the op's running hash (a split op's pieces share one)."""
    n = len(v)
    if n <= CHUNK and not split:
        rd.read_into(v)
        sums[idx] = checksum(v)
        return
    h = hashers.setdefault(idx, StreamingChecksum())
    for s in range(0, n, CHUNK):
        chunk = v[s : s + CHUNK]
        rd.read_into(chunk)
        h.update(chunk)


def start_read(c: Conn, hdr: bytes, v: memoryview, with_checksum: bool) -> tuple[int, int]:
    """Send one READ and wait for its response header. Returns the header's position in the
    receive buffer and how many payload bytes already landed in `v`."""
    sock, rd, hsize = c.sock, c.rd, RESPONSE.size
    n = len(v)
    sock.sendall(hdr)
    if n <= SMALL or rd.start != rd.end:
        return rd.fill(hsize, n <= SMALL), 0
    # Header into the receive buffer and payload straight into dst: one syscall.
    first = v[: CHUNK if with_checksum else RECV_CHUNK]
    got = sock.recvmsg_into([rd.view[:hsize], first])[0]
    if not got:
        raise Closed("connection closed by peer")
    rd.start = 0
    rd.end = got if got < hsize else hsize
    already = got - hsize if got > hsize else 0
    return rd.fill(hsize, False), already


def send_write(sock: socket.socket, hdr: bytes, v: memoryview, with_checksum: bool) -> int | None:
    """Send one WRITE; returns the payload's checksum when asked."""
    if with_checksum and len(v) > CHUNK:
        sock.sendall(hdr)
        h = StreamingChecksum()
        _send_hashed(sock, v, h)
        return h.digest()
    total = checksum(v) if with_checksum else None
    sendv(sock, [hdr, v])
    return total


def finish_read(rd: Reader, v: memoryview, already: int, with_checksum: bool) -> list[int] | None:
    """The rest of one READ's payload into `v` (after `already` bytes), hashed when asked."""
    n = len(v)
    if not with_checksum or n <= CHUNK:
        if already < n:
            rd.read_into(v[already:])
        return [checksum(v)] if with_checksum else None
    h = StreamingChecksum()
    for s in range(0, n, CHUNK):
        e = s + CHUNK if s + CHUNK < n else n
        if e > already:
            rd.read_into(v[max(s, already) : e])
        h.update(v[s:e])
    return [h.digest()]
