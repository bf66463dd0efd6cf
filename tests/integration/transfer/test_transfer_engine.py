"""The transfer engine against a TransferServer running in another process, over real sockets."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import AuthError, TransferError
from mooncake_k8s.common.netutil import split_address
from mooncake_k8s.transfer import (
    Peer,
    ReadOp,
    Segment,
    SegmentDesc,
    Tier,
    TransferEngine,
    TransferRejected,
    TransferServer,
    WriteOp,
)
from mooncake_k8s.transfer import frames as fr

pytestmark = pytest.mark.timeout(60)

KiB, MiB = 1 << 10, 1 << 20
TOKEN = "s3cret-token"
HERE = Path(__file__).parent


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str
    dram: SegmentDesc
    ssd: SegmentDesc

    def peer(self, host_id: str = "remote-host") -> Peer:
        return Peer("node-a", self.address, host_id)

    def alive(self) -> bool:
        return self.proc.poll() is None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ssd_dir = tmp_path_factory.mktemp("ssd")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "transfer_server_proc.py"), TOKEN, str(ssd_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        descs = [
            SegmentDesc(s["name"], Tier(s["tier"]), s["size"], s["path"]) for s in info["segments"]
        ]
        yield Server(proc, info["address"], descs[0], descs[1])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    for d in descs:
        assert not os.path.exists(d.path), "owner must remove its segment files"


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with TransferEngine(TOKEN, transport="tcp") as e:
        yield e


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def make_buffer(kind: str, size: int) -> Any:
    if kind == "numpy":
        return np.zeros(size, dtype=np.uint8)
    if kind == "bytearray":
        return bytearray(size)
    return mv(bytearray(size))


def as_bytes(buf: Any) -> bytes:
    return buf.tobytes() if isinstance(buf, np.ndarray) else bytes(buf)


def mv(buf: Any) -> memoryview:
    return memoryview(buf)


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview"])
@pytest.mark.parametrize("size", [64 * KiB, 1 * MiB, 16 * MiB])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_round_trip(server: Server, transport: str, size: int, kind: str) -> None:
    data = payload(size, size + len(kind))
    src: Any = data if kind == "numpy" else (
        bytearray(data.tobytes()) if kind == "bytearray" else mv(data.tobytes())
    )
    offset = 3 * MiB + 17  # unaligned on purpose
    with TransferEngine(TOKEN, transport=transport) as eng:
        peer = server.peer()
        assert eng.transport_name(peer) == transport
        sums = eng.write(peer, [WriteOp(server.dram, offset, src)], with_checksum=True)
        assert sums == [checksum(data.tobytes())]
        dst = make_buffer(kind, size)
        assert eng.read(peer, [ReadOp(server.dram, offset, dst)]) is None
        assert as_bytes(dst) == data.tobytes()
        dst2 = make_buffer(kind, size)
        assert eng.read(peer, [ReadOp(server.dram, offset, dst2)], with_checksum=True) == sums
        assert as_bytes(dst2) == data.tobytes()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_ssd_segment_round_trip(server: Server, transport: str) -> None:
    data = payload(2 * MiB + 5, 7)
    with TransferEngine(TOKEN, transport=transport) as eng:
        peer = server.peer()
        eng.write(peer, [WriteOp(server.ssd, 1000, mv(data))])
        out = np.empty_like(data)
        assert eng.read(peer, [ReadOp(server.ssd, 1000, mv(out))], True) == [
            checksum(data.tobytes())
        ]
        assert np.array_equal(out, data)


def test_tcp_writes_visible_through_shm(server: Server, engine: TransferEngine) -> None:
    data = payload(300 * KiB, 3)
    engine.write(server.peer(), [WriteOp(server.dram, 40 * MiB, mv(data))])
    with TransferEngine(TOKEN, transport="shm") as shm:
        out = bytearray(len(data))
        shm.read(server.peer(), [ReadOp(server.dram, 40 * MiB, mv(out))])
    assert bytes(out) == data.tobytes()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("count,size", [(500, 4 * KiB), (100, 64 * KiB), (3, 5 * MiB)])
def test_batches(server: Server, transport: str, count: int, size: int) -> None:
    base = 20 * MiB if size < MiB else 0
    data = payload(count * size, count)
    with TransferEngine(TOKEN, transport=transport) as eng:
        peer = server.peer()
        wops = [
            WriteOp(server.dram, base + i * size, mv(data[i * size : (i + 1) * size]))
            for i in range(count)
        ]
        want = [checksum(data[i * size : (i + 1) * size].tobytes()) for i in range(count)]
        assert eng.write(peer, wops, with_checksum=True) == want
        out = np.zeros_like(data)
        rops = [
            ReadOp(server.dram, base + i * size, mv(out[i * size : (i + 1) * size]))
            for i in range(count)
        ]
        assert eng.read(peer, rops, with_checksum=True) == want
        assert np.array_equal(out, data)
        out[:] = 0
        assert eng.read(peer, rops) is None
        assert np.array_equal(out, data)


def test_empty_batch_and_zero_length(server: Server, engine: TransferEngine) -> None:
    peer = server.peer()
    assert engine.read(peer, []) is None
    assert engine.read(peer, [], with_checksum=True) == []
    z = mv(bytearray(0))
    assert engine.read(peer, [ReadOp(server.dram, 5, z)], True) == [checksum(b"")]
    assert engine.write(peer, [WriteOp(server.dram, 5, z)], True) == [checksum(b"")]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_concurrent_threads(server: Server, transport: str) -> None:
    errors: list[BaseException] = []
    size = 96 * KiB
    with TransferEngine(TOKEN, transport=transport, connections_per_peer=3) as eng:
        peer = server.peer()

        def worker(t: int) -> None:
            try:
                for i in range(25):
                    data = payload(size, t * 1000 + i)
                    off = 48 * MiB + t * size
                    eng.write(peer, [WriteOp(server.dram, off, mv(data))])
                    out = bytearray(size)
                    got = eng.read(peer, [ReadOp(server.dram, off, mv(out))], True)
                    assert got == [checksum(data.tobytes())]
                    assert bytes(out) == data.tobytes()
            except BaseException as e:  # collected and re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=45)
    assert not errors, errors


# -- transport choice ----------------------------------------------------------------------------


def test_auto_picks_shm_on_same_host_and_tcp_elsewhere(server: Server) -> None:
    with TransferEngine(TOKEN, host_id="this-host") as eng:
        same, other = server.peer("this-host"), server.peer("other-host")
        assert eng.transport_name(same) == "shm"
        assert eng.transport_name(other) == "tcp"
        data = payload(64 * KiB, 11)
        eng.write(same, [WriteOp(server.dram, 0, mv(data))])
        out = bytearray(64 * KiB)
        eng.read(other, [ReadOp(server.dram, 0, mv(out))])
        assert bytes(out) == data.tobytes()


def test_auto_falls_back_to_tcp_when_mapping_fails(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    bad = replace(server.dram, path="/nonexistent/dir/file")  # cannot be mapped here
    with TransferEngine(TOKEN, host_id="h") as eng:
        peer = server.peer("h")
        assert eng.transport_name(peer) == "shm"
        data = payload(10 * KiB, 5)
        eng.write(peer, [WriteOp(bad, 100, mv(data))])
        assert eng.transport_name(peer) == "tcp"
        assert "falling back to TCP" in caplog.text
        out = bytearray(len(data))
        eng.read(peer, [ReadOp(server.dram, 100, mv(out))])
        assert bytes(out) == data.tobytes()
        eng.forget(peer)
        assert eng.transport_name(peer) == "shm"


def test_forced_shm_mapping_failure_is_transfer_error(server: Server) -> None:
    bad = replace(server.dram, path="/nonexistent/dir/file")
    with TransferEngine(TOKEN, transport="shm") as eng, pytest.raises(TransferError):
        eng.read(server.peer(), [ReadOp(bad, 0, mv(bytearray(10)))])


def test_rdma_status_reported(caplog: pytest.LogCaptureFixture) -> None:
    with TransferEngine(TOKEN) as eng:
        st = eng.rdma_status()
    if not os.path.isdir("/sys/class/infiniband"):
        assert not st.available
        assert "infiniband" in st.reason


# -- errors --------------------------------------------------------------------------------------


def test_wrong_token_is_auth_error_and_server_keeps_serving(server: Server) -> None:
    with TransferEngine("wrong-token", transport="tcp") as bad, pytest.raises(AuthError):
        bad.read(server.peer(), [ReadOp(server.dram, 0, mv(bytearray(8)))])
    with TransferEngine("", transport="tcp") as empty, pytest.raises(AuthError):
        empty.read(server.peer(), [ReadOp(server.dram, 0, mv(bytearray(8)))])
    check_serving(server)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_out_of_bounds_rejected_locally(server: Server, transport: str) -> None:
    with TransferEngine(TOKEN, transport=transport) as eng:
        peer = server.peer()
        end = server.dram.size
        with pytest.raises(TransferRejected, match="outside segment"):
            eng.read(peer, [ReadOp(server.dram, end - 4, mv(bytearray(8)))])
        with pytest.raises(TransferRejected, match="outside segment"):
            eng.write(peer, [WriteOp(server.dram, -1, mv(bytearray(8)))])
    check_serving(server)


def test_out_of_bounds_rejected_by_server(server: Server, engine: TransferEngine) -> None:
    # The descriptor claims a bigger segment than the server has: the server refuses.
    lying = replace(server.dram, size=server.dram.size * 4)
    peer = server.peer()
    canary = payload(4 * KiB, 99)
    engine.write(peer, [WriteOp(server.dram, server.dram.size - 4 * KiB, mv(canary))])
    for ops_kind in ("read", "write"):
        with pytest.raises(TransferRejected, match="outside segment") as ei:
            if ops_kind == "read":
                engine.read(peer, [ReadOp(lying, server.dram.size - 10, mv(bytearray(64)))])
            else:
                engine.write(
                    peer, [WriteOp(lying, server.dram.size - 4 * KiB, mv(bytearray(MiB)))]
                )
        assert ei.value.code == fr.ST_OUT_OF_RANGE
    # Nothing of the refused write landed in the segment; the pooled connection still works.
    out = bytearray(4 * KiB)
    engine.read(peer, [ReadOp(server.dram, server.dram.size - 4 * KiB, mv(out))])
    assert bytes(out) == canary.tobytes()


def test_error_in_a_batch_keeps_connection_in_sync(server: Server, engine: TransferEngine) -> None:
    peer = server.peer()
    ghost = SegmentDesc("no-such-segment", Tier.DRAM, 1 * MiB, "/dev/shm/mooncake-no-such-segment")
    data = payload(8 * KiB, 8)
    engine.write(peer, [WriteOp(server.dram, 0, mv(data))])
    outs = [bytearray(8 * KiB) for _ in range(3)]
    ops = [ReadOp(server.dram, 0, mv(outs[0])), ReadOp(ghost, 0, mv(outs[1])),
           ReadOp(server.dram, 0, mv(outs[2]))]
    with pytest.raises(TransferRejected, match="unknown segment") as ei:
        engine.read(peer, ops)
    assert ei.value.code == fr.ST_UNKNOWN_SEGMENT
    assert bytes(outs[0]) == bytes(outs[2]) == data.tobytes()
    with pytest.raises(TransferRejected, match="unknown segment"):
        engine.write(peer, [WriteOp(ghost, 0, mv(data))])
    check_serving(server, engine)


# -- hostile bytes on the wire -------------------------------------------------------------------


def raw_conn(server: Server, hello: bool = True) -> socket.socket:
    s = socket.create_connection(split_address(server.address), timeout=10)
    if hello:
        s.sendall(fr.encode_hello(TOKEN))
        status, msg, _ = fr.decode_hello_reply(recv_exact(s, fr.HELLO_REPLY.size))
        assert status == fr.HELLO_OK, msg
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def assert_closed_by_server(s: socket.socket) -> None:
    try:
        while True:
            if not s.recv(65536):
                break
    except ConnectionResetError:
        pass
    finally:
        s.close()


def check_serving(server: Server, engine: TransferEngine | None = None) -> None:
    assert server.alive()
    eng = engine or TransferEngine(TOKEN, transport="tcp")
    try:
        data = payload(200 * KiB, 1234)
        eng.write(server.peer(), [WriteOp(server.dram, 60 * MiB, mv(data))])
        out = bytearray(len(data))
        eng.read(server.peer(), [ReadOp(server.dram, 60 * MiB, mv(out))])
        assert bytes(out) == data.tobytes()
    finally:
        if engine is None:
            eng.close()


GARBAGE_AFTER_HELLO = [
    pytest.param(b"\x00" * 64, id="zeros"),
    pytest.param(os.urandom(4096), id="random"),
    pytest.param(fr.REQUEST.pack(b"MQ", 9, 4, 1, 0, 10) + b"abcd", id="bad-op"),
    pytest.param(fr.REQUEST.pack(b"MQ", 1, 0, 1, 0, 10), id="empty-name"),
    pytest.param(fr.REQUEST.pack(b"MQ", 1, 4, 1, 0, 10) + b"a/..", id="bad-name"),
    pytest.param(fr.REQUEST.pack(b"MQ", 2, 4, 1, 0, 1 << 40) + b"abcd", id="huge-length"),
]


@pytest.mark.parametrize("garbage", GARBAGE_AFTER_HELLO)
def test_garbage_frames_close_connection(server: Server, garbage: bytes) -> None:
    s = raw_conn(server)
    s.sendall(garbage)
    assert_closed_by_server(s)
    check_serving(server)


def test_huge_rejected_write_closes_connection(server: Server) -> None:
    s = raw_conn(server)
    name = server.dram.name.encode()
    s.sendall(fr.encode_request(fr.OP_WRITE, name, 1, server.dram.size, 1 << 30))
    assert_closed_by_server(s)
    check_serving(server)


def test_garbage_handshake_closes_connection(server: Server) -> None:
    junks = (b"GET / HTTP/1.1\r\n\r\n", os.urandom(512), struct.pack("!4sHH", b"MCTE", 1, 60000))
    for junk in junks:
        s = raw_conn(server, hello=False)
        s.sendall(junk)
        assert_closed_by_server(s)
    s = raw_conn(server, hello=False)
    s.sendall(struct.pack("!4sHH", b"MCTE", 99, 0))
    status, msg, _ = fr.decode_hello_reply(recv_exact(s, fr.HELLO_REPLY.size + 64)[:200])
    assert status == fr.HELLO_BAD_VERSION and "version" in msg
    assert_closed_by_server(s)
    check_serving(server)


def test_truncated_frames_close_connection(server: Server) -> None:
    name = server.dram.name.encode()
    frame = fr.encode_request(fr.OP_WRITE, name, 7, 0, 1000) + b"x" * 1000
    for cut in (3, fr.REQUEST.size, fr.REQUEST.size + 2, len(frame) - 1):
        s = raw_conn(server)
        s.sendall(frame[:cut])
        s.shutdown(socket.SHUT_WR)
        assert_closed_by_server(s)
    hello = fr.encode_hello(TOKEN)
    s = raw_conn(server, hello=False)
    s.sendall(hello[:-3])
    s.shutdown(socket.SHUT_WR)
    assert_closed_by_server(s)
    check_serving(server)


def test_valid_raw_frames(server: Server) -> None:
    """The wire format as documented in frames: a raw client can read and write."""
    s = raw_conn(server)
    name = server.dram.name.encode()
    try:
        s.sendall(fr.encode_request(fr.OP_WRITE, name, 41, 123, 5) + b"hello")
        resp, _ = fr.decode_response(recv_exact(s, fr.RESPONSE.size), fr.OP_WRITE)
        assert (resp.status, resp.req_id, resp.length) == (fr.ST_OK, 41, 5)
        s.sendall(fr.encode_request(fr.OP_READ, name, 42, 123, 5))
        resp, _ = fr.decode_response(recv_exact(s, fr.RESPONSE.size + 5))
        assert (resp.status, resp.req_id, resp.payload) == (fr.ST_OK, 42, b"hello")
        s.sendall(fr.encode_request(fr.OP_READ, b"nope", 43, 0, 5))
        head = recv_exact(s, fr.RESPONSE.size)
        _st, _rid, mlen = fr.decode_response_header(head)
        resp, _ = fr.decode_response(head + recv_exact(s, mlen))
        assert resp.status == fr.ST_UNKNOWN_SEGMENT and "nope" in resp.message
    finally:
        s.close()


# -- binding and in-process server management -----------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                found.add(addr)
    return found


def test_listener_bound_to_given_host_only(server: Server) -> None:
    host, port = split_address(server.address)
    assert host == "127.0.0.1"
    assert listening_addresses(port) == {"0100007F"}


def test_segments_added_and_removed_at_runtime() -> None:
    a = Segment.create_shm(f"rt-a-{os.getpid()}", MiB, replace=True)
    b = Segment.create_shm(f"rt-b-{os.getpid()}", MiB, replace=True)
    srv = TransferServer({a.desc.name: a}, token=TOKEN)
    srv.start()
    try:
        peer = Peer("local", srv.address, "elsewhere")
        with TransferEngine(TOKEN, transport="tcp") as eng:
            eng.write(peer, [WriteOp(a.desc, 0, mv(b"aaaa"))])
            with pytest.raises(TransferRejected, match="unknown segment"):
                eng.write(peer, [WriteOp(b.desc, 0, mv(b"bbbb"))])
            srv.add_segment(b)
            eng.write(peer, [WriteOp(b.desc, 0, mv(b"bbbb"))])
            assert bytes(b.buf[:4]) == b"bbbb"
            assert srv.remove_segment(a.desc.name) is a
            with pytest.raises(TransferRejected, match="unknown segment"):
                eng.read(peer, [ReadOp(a.desc, 0, mv(bytearray(4)))])
    finally:
        srv.stop()
        a.close()
        b.close()


def test_stale_pooled_connection_is_reopened() -> None:
    seg = Segment.create_shm(f"rt-s-{os.getpid()}", MiB, replace=True)
    srv = TransferServer({seg.desc.name: seg}, token=TOKEN)
    srv.start()
    port = srv.port
    try:
        peer = Peer("local", srv.address, "elsewhere")
        with TransferEngine(TOKEN, transport="tcp") as eng:
            eng.write(peer, [WriteOp(seg.desc, 0, mv(b"one!"))])
            srv.stop()  # drops the pooled connection
            srv = TransferServer({seg.desc.name: seg}, port=port, token=TOKEN)
            srv.start()
            out = bytearray(4)
            eng.read(peer, [ReadOp(seg.desc, 0, mv(out))])
            assert out == b"one!"
    finally:
        srv.stop()
        seg.close()


def test_connection_refused_is_transfer_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    desc = SegmentDesc("x", Tier.DRAM, 10, "/dev/shm/mooncake-x")
    with TransferEngine(TOKEN, transport="tcp") as eng, pytest.raises(TransferError):
        eng.read(Peer("n", f"127.0.0.1:{port}", "h"), [ReadOp(desc, 0, mv(bytearray(4)))])


def test_auth_failure_logged_without_token(caplog: pytest.LogCaptureFixture) -> None:
    seg = Segment.create_shm(f"rt-t-{os.getpid()}", MiB, replace=True)
    srv = TransferServer({seg.desc.name: seg}, token=TOKEN)
    srv.start()
    try:
        peer = Peer("local", srv.address, "elsewhere")
        with caplog.at_level("DEBUG"):
            with TransferEngine("not-the-token", transport="tcp") as eng, pytest.raises(AuthError):
                eng.read(peer, [ReadOp(seg.desc, 0, mv(bytearray(4)))])
            s = socket.create_connection(split_address(srv.address), timeout=5)
            s.sendall(fr.encode_hello(TOKEN) + b"\xff" * 40)
            assert_closed_by_server(s)
            srv.stop()
        assert "invalid cluster token" in caplog.text
        assert "bad request magic" in caplog.text
        assert TOKEN not in caplog.text and "not-the-token" not in caplog.text
    finally:
        srv.stop()
        seg.close()
