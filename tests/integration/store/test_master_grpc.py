"""The master's gRPC API over a real socket, called with the generated stub."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2_grpc as pb_grpc
from mooncake_k8s.store.master import MasterConfig, MasterServer

TOKEN = "s3cret-token"
MD = call_metadata(TOKEN)
KiB = 1 << 10


@pytest.fixture
def server() -> Iterator[MasterServer]:
    srv = MasterServer(
        MasterConfig(host="127.0.0.1", port=0, token=TOKEN, metrics_port=0, node_timeout_s=2,
                     tick_interval_s=0.02, recovery_grace_s=0)
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def stub(server: MasterServer) -> Iterator[pb_grpc.MasterStub]:
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]


def register(stub: pb_grpc.MasterStub, node_id: str = "n0", size: int = 1 << 20) -> str:
    resp = stub.RegisterNode(
        pb.RegisterNodeRequest(
            node_id=node_id, address="127.0.0.1:9999", host_id="h",
            segments=[pb.SegmentInfo(name=f"{node_id}-dram-0", tier=pb.DRAM, size=size,
                                     path=f"/dev/shm/{node_id}")],
        ),
        metadata=MD, timeout=5,
    )
    return str(resp.master_id)


def test_binds_exactly_the_given_address(server: MasterServer) -> None:
    assert server.address.startswith("127.0.0.1:") and server.port > 0
    busy = MasterServer(MasterConfig(port=server.port))
    with pytest.raises(OSError, match="cannot bind"):
        busy.start()


def test_token_is_required(server: MasterServer) -> None:
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]
        for md in [(), call_metadata("wrong")]:
            with pytest.raises(grpc.RpcError) as ei:
                stub.Stats(pb.StatsRequest(), metadata=md, timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (ei.value.details() or "")
            with pytest.raises(grpc.RpcError) as ei:
                next(iter(stub.Watch(pb.WatchRequest(), metadata=md, timeout=5)))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Stats(pb.StatsRequest(), metadata=MD, timeout=5).master_id == server.master_id


def test_put_lookup_remove_round_trip(server: MasterServer, stub: pb_grpc.MasterStub) -> None:
    master_id = register(stub)
    start = stub.PutStart(pb.PutStartRequest(key="k1", size=5000, replicas=1), metadata=MD)
    assert start.put_id and start.replicas[0].segment == "n0-dram-0"
    assert start.replicas[0].address == "127.0.0.1:9999"
    assert list(stub.Exists(pb.ExistsRequest(keys=["k1"]), metadata=MD).exists) == [False]
    stub.PutEnd(pb.PutEndRequest(key="k1", put_id=start.put_id, checksum=42), metadata=MD)
    got = stub.GetReplicas(pb.GetReplicasRequest(keys=["k1", "nope"], lease_ms=500), metadata=MD)
    assert [o.found for o in got.objects] == [True, False]
    assert got.objects[0].size == 5000 and got.objects[0].checksum == 42
    assert got.objects[0].replicas[0].offset == start.replicas[0].offset
    assert got.lease_id and got.lease_expires_unix_ms > time.time() * 1000
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=got.lease_id), metadata=MD)
    ex = stub.Exists(pb.ExistsRequest(keys=["k1", "nope", "k1"]), metadata=MD)
    assert list(ex.exists) == [True, False, True] and ex.prefix_len == 1
    pinned = stub.Pin(pb.PinRequest(keys=["k1", "x"], pin=True), metadata=MD).ok
    assert list(pinned) == [True, False]
    again = stub.PutStart(pb.PutStartRequest(key="k1", size=5000), metadata=MD)
    assert again.exists and again.put_id == 0
    # batch forms
    bs = stub.BatchPutStart(
        pb.BatchPutStartRequest(items=[pb.PutStartRequest(key=f"b{i}", size=100) for i in range(3)]
                                + [pb.PutStartRequest(key="", size=1)]),
        metadata=MD,
    )
    assert [r.code for r in bs.results] == [pb.ERROR_NONE] * 3 + [pb.ERROR_INVALID]
    be = stub.BatchPutEnd(
        pb.BatchPutEndRequest(items=[pb.PutEndRequest(key=f"b{i}", put_id=r.ok.put_id, checksum=1)
                                     for i, r in enumerate(bs.results[:3])]),
        metadata=MD,
    )
    assert list(be.errors) == ["", "", ""]
    removed = stub.Remove(pb.RemoveRequest(keys=["k1", "b0", "zz"]), metadata=MD).removed
    assert list(removed) == [True, True, False]
    stats = stub.Stats(pb.StatsRequest(), metadata=MD)
    assert (stats.objects, stats.nodes, stats.master_id) == (2, 1, master_id)
    # revoke
    r = stub.PutStart(pb.PutStartRequest(key="rv", size=10), metadata=MD)
    stub.PutRevoke(pb.PutRevokeRequest(key="rv", put_id=r.put_id), metadata=MD)
    assert stub.Stats(pb.StatsRequest(), metadata=MD).pending_puts == 0


def test_errors_map_to_status_codes(server: MasterServer, stub: pb_grpc.MasterStub) -> None:
    def code_of(fn: object, req: object) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as ei:
            fn(req, metadata=MD, timeout=5)  # type: ignore[operator]
        return ei.value.code(), ei.value.details() or ""

    assert code_of(stub.PutStart, pb.PutStartRequest(key="k", size=10)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "no storage segments are registered"
    )
    register(stub, size=64 * KiB)
    code, msg = code_of(stub.PutStart, pb.PutStartRequest(key="", size=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg
    code, msg = code_of(stub.PutStart, pb.PutStartRequest(key="k", size=10 * 1 << 20))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "too large" in msg
    code, msg = code_of(stub.PutEnd, pb.PutEndRequest(key="k", put_id=12345))
    assert code == grpc.StatusCode.NOT_FOUND and "12345" in msg
    code, msg = code_of(stub.RegisterNode, pb.RegisterNodeRequest(node_id="x", address="a:1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "segment" in msg
    stub.PutStart(pb.PutStartRequest(key="fill", size=64 * KiB), metadata=MD)
    code, _ = code_of(stub.PutStart, pb.PutStartRequest(key="k2", size=KiB))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as ei:  # streaming call errors surface on first read
        next(iter(stub.NodeCommands(pb.NodeCommandsRequest(node_id="ghost"), metadata=MD,
                                    timeout=5)))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # still serving
    assert stub.Stats(pb.StatsRequest(), metadata=MD, timeout=5).nodes == 1


def test_watch_and_node_commands_stream(server: MasterServer, stub: pb_grpc.MasterStub) -> None:
    master_id = register(stub)
    events: queue.Queue[pb.BlockEvent] = queue.Queue()
    watch = stub.Watch(pb.WatchRequest(), metadata=MD)
    cmds = stub.NodeCommands(pb.NodeCommandsRequest(node_id="n0", master_id=master_id),
                             metadata=MD)
    def consume() -> None:
        try:
            for e in watch:
                events.put(e)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    time.sleep(0.2)  # the subscription is registered once the stream is running
    r = stub.PutStart(pb.PutStartRequest(key="w", size=100), metadata=MD)
    stub.PutEnd(pb.PutEndRequest(key="w", put_id=r.put_id, checksum=9), metadata=MD)
    stub.Remove(pb.RemoveRequest(keys=["w"]), metadata=MD)
    got = [events.get(timeout=5) for _ in range(2)]
    assert [(e.kind, e.key, e.node_id) for e in got] == [
        (pb.BlockEvent.STORED, "w", "n0"), (pb.BlockEvent.REMOVED, "w", "n0")
    ]
    assert got[0].seq < got[1].seq
    got_cmds: list[pb.NodeCommand] = []
    while len(got_cmds) < 2:  # in batches: both may come in one message
        got_cmds += next(iter(cmds)).commands
    first, second = got_cmds
    assert (first.kind, first.key, first.checksum) == (pb.NodeCommand.COMMITTED, "w", 9)
    assert second.kind == pb.NodeCommand.FREED
    watch.cancel()
    t.join(5)
    assert not t.is_alive()
    # a stale master id ends the stream at once
    with pytest.raises(grpc.RpcError) as ei:
        next(iter(stub.NodeCommands(pb.NodeCommandsRequest(node_id="n0", master_id="old"),
                                    metadata=MD, timeout=5)))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    cmds.cancel()


def test_heartbeat_and_node_timeout(server: MasterServer, stub: pb_grpc.MasterStub) -> None:
    hb = stub.Heartbeat(pb.HeartbeatRequest(node_id="n0"), metadata=MD)
    assert hb.reregister and hb.master_id == server.master_id
    register(stub)
    assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="n0"), metadata=MD).reregister
    deadline = time.monotonic() + 10
    while stub.Stats(pb.StatsRequest(), metadata=MD).nodes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub.Stats(pb.StatsRequest(), metadata=MD).nodes == 0  # silent for > 2 s: dead
    assert stub.Heartbeat(pb.HeartbeatRequest(node_id="n0"), metadata=MD).reregister


def test_metrics_exposed(server: MasterServer, stub: pb_grpc.MasterStub) -> None:
    register(stub)
    stub.GetReplicas(pb.GetReplicasRequest(keys=["a", "b"]), metadata=MD)
    assert server.metrics_port
    text = urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5
    ).read().decode()
    assert 'mooncake_store_lookups_total{result="miss"} 2.0' in text
    assert 'mooncake_store_capacity_bytes{segment="n0-dram-0",tier="dram"}' in text
    assert "mooncake_store_nodes 1.0" in text
    assert 'mooncake_master_rpc_seconds_count{method="GetReplicas"} 1.0' in text
    for name in ["mooncake_store_objects", "mooncake_store_used_bytes",
                 "mooncake_store_evictions_total", "mooncake_store_spills_total",
                 "mooncake_store_promotions_total"]:
        assert name in text


def test_stop_ends_open_streams_promptly() -> None:
    srv = MasterServer(MasterConfig(port=0, token=TOKEN))
    srv.start()
    ch = grpc.insecure_channel(srv.address)
    stub = pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]
    watch = stub.Watch(pb.WatchRequest(), metadata=MD)
    done = threading.Event()

    def consume() -> None:
        try:
            for _ in watch:
                pass
        except grpc.RpcError:
            pass
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    time.sleep(0.2)
    t0 = time.monotonic()
    srv.stop()
    assert done.wait(5) and time.monotonic() - t0 < 5
    ch.close()


def test_run_master_process_logs_address_not_token(tmp_path: object) -> None:
    port, mport = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_k8s.cli", "store", "master", "--port", str(port),
         "--metrics-port", str(mport), "--token", TOKEN],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=20)
            stats = pb_grpc.MasterStub(ch).Stats(  # type: ignore[no-untyped-call]
                pb.StatsRequest(), metadata=MD, timeout=5)
            assert stats.master_id
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert f"127.0.0.1:{port}" in out and TOKEN not in out
