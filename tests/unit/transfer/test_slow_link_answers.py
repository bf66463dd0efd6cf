"""Waiting for an answer after a large write: slow draining is progress, silence is a stall.

A client's last send of a write returns with up to a socket buffer still in flight; on a slow
link that drains for longer than the receive timeout. `tcp_io.Reader` keeps waiting while the
peer keeps acknowledging our bytes, and raises once nothing is left in flight (or nothing moved
since the last timeout) and still no answer came. Real sockets on loopback, a peer that reads
slowly through a small receive buffer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mooncake_k8s.transfer.tcp_io import Reader, sendv, tune

PAYLOAD = 2 << 20
TIMEOUT_S = 0.3


@contextmanager
def _peer(read_chunk: int, pause_s: float, answer: bool) -> Iterator[socket.socket]:
    """A connected client socket whose peer reads PAYLOAD bytes `read_chunk` at a time with a
    pause between reads, then answers 8 bytes (or, `answer=False`, says nothing)."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited by the accept
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    done = threading.Event()

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            left = PAYLOAD
            while left:
                got = conn.recv(min(read_chunk, left))
                if not got:
                    return
                left -= len(got)
                time.sleep(pause_s)
            if answer:
                conn.sendall(b"answered")
            done.wait(10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cli = socket.create_connection(lst.getsockname())
    tune(cli, TIMEOUT_S)
    try:
        yield cli
    finally:
        done.set()
        cli.close()
        t.join(10)
        lst.close()


def _write(cli: socket.socket) -> None:
    data = memoryview(bytes(PAYLOAD))
    while True:  # our own send may time out while the peer's window is shut: not the point
        try:
            sendv(cli, [data])
            return
        except (BlockingIOError, TimeoutError) as e:
            raise AssertionError("the slow peer stalled our send") from e


def test_an_answer_after_a_slow_drain_arrives() -> None:
    # 256 KiB every 0.1 s: the bytes in flight after the last send take well over 0.3 s
    with _peer(256 << 10, 0.1, answer=True) as cli:
        _write(cli)
        reader = Reader(cli)
        start = reader.fill(8)
        assert bytes(reader.view[start:start + 8]) == b"answered"


def test_no_answer_once_everything_is_acknowledged_is_a_stall() -> None:
    with _peer(1 << 20, 0.0, answer=False) as cli:
        _write(cli)
        with pytest.raises((BlockingIOError, TimeoutError)):
            Reader(cli).fill(8)
