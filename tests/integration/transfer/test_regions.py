"""Registered memory regions (PD handoff into an engine's own KV buffers) over the real TCP
transport, and the SGLang-facing transfer engine built on them, in two real processes.

The receiving side is a child process that registers numpy buffers (as SGLang's decode
registers its KV pool) and serves them; this process writes into them by raw address."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_k8s.common.errors import AuthError
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import Peer
from mooncake_k8s.transfer.regions import RegionTable, RegionWriter
from mooncake_k8s.transfer.tcp_server import TransferServer

TOKEN = "regions-test-token"

RECEIVER = textwrap.dedent("""
    import json, os, sys, numpy as np
    from mooncake_k8s.engine.sglang.transfer import OurTransferEngine
    os.environ["MOONCAKE_CLUSTER_TOKEN"] = sys.argv[1]
    te = OurTransferEngine("127.0.0.1")
    bufs = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(3)]
    assert te.batch_register([b.ctypes.data for b in bufs], [b.size for b in bufs]) == 0
    print(json.dumps({"session": te.get_session_id(),
                      "bases": [b.ctypes.data for b in bufs]}), flush=True)
    for line in sys.stdin:  # "dump": print the buffers' checksums
        if line.strip() == "dereg":
            te.batch_deregister([bufs[2].ctypes.data])
        print(json.dumps([int(b.astype(np.uint64).sum()) for b in bufs]), flush=True)
""")


@pytest.fixture
def receiver() -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, TOKEN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    yield proc, info
    proc.kill()
    proc.wait(10)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def _sums(proc: subprocess.Popen[str], cmd: str = "dump") -> list[int]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    out: list[int] = json.loads(proc.stdout.readline())
    return out


def test_writes_land_at_raw_addresses_in_another_process(
        receiver: tuple[subprocess.Popen[str], dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_k8s.engine.sglang.transfer import OurTransferEngine

    proc, info = receiver
    bases = info["bases"]
    assert isinstance(bases, list)
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", TOKEN)
    te = OurTransferEngine("127.0.0.1")
    try:
        src = np.arange(4096, dtype=np.uint8)
        srcs = [src.ctypes.data, src.ctypes.data + 1000]
        dsts = [bases[0] + 100, bases[1] + 60000]
        assert te.batch_transfer_sync(str(info["session"]), srcs, dsts, [1000, 3000]) == 0
        sums = _sums(proc)
        assert sums[0] == int(src[:1000].astype(np.uint64).sum())
        assert sums[1] == int(src[1000:4000].astype(np.uint64).sum())
        assert sums[2] == 0
        assert te.send_probe(str(info["session"])) == 0
        # past a region's end, into no region, after a deregistration: refused, nothing written
        assert te.batch_transfer_sync(str(info["session"]), [src.ctypes.data],
                                      [bases[0] + (1 << 16) - 10], [100]) == -1
        assert te.batch_transfer_sync(str(info["session"]), [src.ctypes.data], [16], [8]) == -1
        _sums(proc, "dereg")
        assert te.batch_transfer_sync(str(info["session"]), [src.ctypes.data],
                                      [bases[2]], [100]) == -1
        assert _sums(proc) == sums
        # a peer that is gone is a failed transfer (SGLang fails the request over), not a hang
        proc.kill()
        proc.wait(10)
        assert te.batch_transfer_sync(str(info["session"]), srcs, dsts, [1000, 3000]) == -1
        assert te.send_probe(str(info["session"])) == -1
    finally:
        te.close()


def test_wrong_token_cannot_write() -> None:
    srv = TransferServer({}, token=TOKEN)
    srv.start()
    table = RegionTable(srv)
    buf = np.zeros(4096, dtype=np.uint8)
    table.register([buf.ctypes.data], [buf.size])
    try:
        with TransferEngine("not-the-token", transport="tcp", timeout_s=5) as eng:
            writer = RegionWriter(eng)
            src = np.ones(64, dtype=np.uint8)
            with pytest.raises(AuthError):
                writer.write(Peer("x", srv.address, "elsewhere"), [src.ctypes.data],
                             [buf.ctypes.data], [64])
        assert not buf.any()
    finally:
        srv.stop()
