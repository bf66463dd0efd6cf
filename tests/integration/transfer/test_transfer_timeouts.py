"""A paused or black-holed transfer peer fails within the client's I/O timeout, not its call
timeout; a peer that is merely busy is not failed by the pool wait."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument, TransferTimeout
from mooncake_k8s.store.testing import pause_pid
from mooncake_k8s.transfer import ReadOp, SegmentDesc, TcpTransport, Tier

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TOKEN = "s3cret-token"
HERE = Path(__file__).parent
DESC = SegmentDesc("x", Tier.DRAM, 64 * MiB, "")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, str, SegmentDesc]]:
    """A real TransferServer process: (pid, address, its DRAM segment)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "transfer_server_proc.py"), TOKEN, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        info = json.loads(proc.stdout.readline())
        s = info["segments"][0]
        desc = SegmentDesc(s["name"], Tier(s["tier"]), s["size"], s["path"])
        yield proc.pid, info["address"], desc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _timed_read(t: TcpTransport, desc: SegmentDesc, size: int = MiB) -> float:
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        t.read([ReadOp(desc, 0, memoryview(bytearray(size)))])
    return time.monotonic() - start


def test_paused_peer_fails_within_the_io_timeout(server: tuple[int, str, SegmentDesc]) -> None:
    pid, address, desc = server
    warm = TcpTransport(address, TOKEN, 1, timeout_s=30, io_timeout_s=0.5)
    cold = TcpTransport(address, TOKEN, 1, timeout_s=30, io_timeout_s=0.5)
    try:
        warm.read([ReadOp(desc, 0, memoryview(bytearray(MiB)))])  # a pooled connection exists now
        pause_pid(pid)
        pooled = _timed_read(warm, desc)  # the request is sent, no response comes
        fresh = _timed_read(cold, desc)  # connect succeeds (kernel backlog), no hello reply
    finally:
        warm.close()
        cold.close()
    print(f"\npaused peer: pooled connection failed after {pooled:.2f}s, "
          f"new connection after {fresh:.2f}s (io timeout 0.5s, call timeout 30s)")
    assert pooled < 30 and fresh < 30


def test_black_holed_peer_fails_within_the_io_timeout() -> None:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        host, port = lst.getsockname()
        # Fill the accept queue: further SYNs are dropped, as by a black hole.
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((host, port))
            fillers.append(s)
        time.sleep(0.2)
        t = TcpTransport(f"{host}:{port}", TOKEN, 1, timeout_s=30, io_timeout_s=0.5)
        try:
            took = _timed_read(t, DESC, 4096)
        finally:
            t.close()
            for s in fillers:
                s.close()
    print(f"\nblack-holed peer failed after {took:.2f}s (io timeout 0.5s, call timeout 30s)")
    assert took < 30


def test_timeouts_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="timeouts"):
        TcpTransport("127.0.0.1:1", TOKEN, 1, timeout_s=10, io_timeout_s=0)
