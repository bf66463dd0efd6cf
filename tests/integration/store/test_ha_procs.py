"""Master HA with real processes: two masters on a real redis-server, storage nodes and clients
given both addresses. The leader is killed (-9) or frozen (SIGSTOP) under a put/get load; what
was acknowledged must stay readable, byte for byte, and a frozen leader that wakes up must not
accept a write."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import grpc
import pytest

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2_grpc as pb_grpc
from mooncake_k8s.store.testing import HaStoreCluster, PutGetLoad

KiB = 1 << 10


def ha_cluster() -> HaStoreCluster:
    cluster = HaStoreCluster()
    cluster.start_masters()
    cluster.start_node("a", "64MiB")
    cluster.start_node("b", "64MiB")
    return cluster


def raw_put_start(address: str, token: str) -> grpc.RpcError | pb.PutStartResponse:
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]
        try:
            resp: pb.PutStartResponse = stub.PutStart(
                pb.PutStartRequest(key="probe", size=KiB), metadata=call_metadata(token),
                timeout=5)
            return resp
        except grpc.RpcError as e:
            return e


def trailers(e: grpc.RpcError) -> dict[str, str]:
    pairs: Any = e.trailing_metadata() or ()  # type: ignore[attr-defined]
    return dict(pairs)


def test_standby_refuses_and_names_the_leader() -> None:
    with ha_cluster() as cluster:
        name, _ = cluster.leader()
        standby = next(n for n in cluster.masters if n != name)
        answer = raw_put_start(f"127.0.0.1:{cluster.ports[standby]}", cluster.token)
        assert isinstance(answer, grpc.RpcError)
        assert answer.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        t = trailers(answer)
        assert t["mooncake-standby"] == "1"
        assert t["mooncake-leader"] == f"127.0.0.1:{cluster.ports[name]}"
        assert "standby" in str(answer.details())  # type: ignore[attr-defined]


def test_leader_killed_under_load_loses_no_acknowledged_put() -> None:
    with ha_cluster() as cluster:
        name, leader = cluster.leader()
        load = PutGetLoad(cluster)
        load.start()
        load.acks_after(time.monotonic(), 50)
        killed = time.monotonic()
        cluster.kill(leader)
        load.acks_after(killed, 50)
        new_name, _ = cluster.leader()
        assert new_name != name
        # The old leader comes back as a standby; the new one keeps leading.
        cluster.start_ha_master(name)
        load.acks_after(time.monotonic(), 20)
        load.finish()
        assert cluster.leader()[0] == new_name
        lost, wrong = load.verify_all()
        assert (lost, wrong, load.wrong) == (0, 0, 0), (lost, wrong, load.wrong)
        assert len(load.acked) >= 120


def test_frozen_leader_that_wakes_up_accepts_no_write() -> None:
    with ha_cluster() as cluster:
        name, leader = cluster.leader()
        load = PutGetLoad(cluster)
        load.start()
        load.acks_after(time.monotonic(), 30)
        cluster.pause(leader)
        frozen = time.monotonic()
        load.acks_after(frozen, 30)  # a standby took over while the leader sleeps
        new_name, _ = cluster.leader()
        assert new_name != name
        cluster.resume(leader)
        answer = raw_put_start(f"127.0.0.1:{cluster.ports[name]}", cluster.token)
        # Refused (it knows it lost the lease), or gone already (it exits when deposed: a call
        # that reaches its server while the server shuts down is CANCELLED by gRPC). Either
        # way no write is accepted, and the exit status below says it was deposed.
        assert isinstance(answer, grpc.RpcError), answer
        assert answer.code() in (  # type: ignore[attr-defined]
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), answer
        assert leader.popen.wait(timeout=15) == 3
        assert "no longer the store master leader" in leader.log()
        load.acks_after(time.monotonic(), 20)
        load.finish()
        lost, wrong = load.verify_all()
        assert (lost, wrong, load.wrong) == (0, 0, 0), (lost, wrong, load.wrong)


@pytest.mark.parametrize(("args", "message"), [
    (["store", "master", "--metadata-backend", "redis"], "needs a Redis URL"),
    (["store", "master", "--metadata-backend", "etcd"], "'etcd' is not one of"),
    (["store", "stats", "--master", "127.0.0.1:1,,127.0.0.1:2"], "empty master address"),
    (["store", "node", "--master", "127.0.0.1", "--node-id", "x"], "not host:port"),
])
def test_bad_ha_options_are_named(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "mooncake_k8s.cli", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
