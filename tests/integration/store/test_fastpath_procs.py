"""The master's fast path with real processes: clients switch to it by themselves, it answers
exactly like gRPC, hostile sockets cannot lock it, and without it everything still works."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from mooncake_k8s.common.errors import AuthError, ObjectExists, ObjectNotFound
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.client.fastpath import FastPathClient, FastPathError
from mooncake_k8s.store.master.fastpath import MAX_UNAUTHENTICATED
from mooncake_k8s.store.testing import StoreCluster
from mooncake_k8s.store.wire import MAGIC, VERSION

KiB = 1 << 10


def fast_port(cluster: StoreCluster) -> int:
    assert cluster.master is not None
    for line in cluster.master.log().splitlines():
        if '"fast_port"' in line:
            return int(line.split('"fast_port":')[1].split(",")[0].strip(" }"))
    raise AssertionError("the master logged no fast port")


def test_clients_switch_to_the_fast_path_and_get_the_same_answers() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "16MiB")
        with cluster.client() as c:
            c.put("k", b"v" * KiB)
            link = c._link
            assert cluster.master_address in link._fast  # learned from the first answer
            c.put("k2", b"w" * KiB)
            with pytest.raises(ObjectExists):
                c.put("k", b"v" * KiB)
            assert c.exists(["k", "k2", "nope"]) == [True, True, False]
            assert bytes(c.get("k2")) == b"w" * KiB
            assert c.remove(["k"]) == [True]
            with pytest.raises(ObjectNotFound):
                c.get("k")
            assert c.stats().objects == 1


def test_fast_path_refuses_a_wrong_token() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        bad = FastPathClient("127.0.0.1", fast_port(cluster), "wrong-token")
        with pytest.raises(FastPathError) as e:
            bad.call("Stats", pb.StatsRequest(), 5)
        assert "token" in e.value.details()
        good = FastPathClient("127.0.0.1", fast_port(cluster), cluster.token)
        resp, _ = good.call("Stats", pb.StatsRequest(), 5)
        assert resp.nodes == 0
        good.close()
        with pytest.raises(AuthError), StoreClient(cluster.master_address, "wrong",
                                                   timeout_s=2) as c:
            c.stats()


def test_a_closed_client_opens_no_connection() -> None:
    """A call racing close() (a lease handed back by a background thread) fails UNAVAILABLE
    and leaves no socket behind that nothing would close."""
    import grpc

    with StoreCluster() as cluster:
        cluster.start_master()
        client = FastPathClient("127.0.0.1", fast_port(cluster), cluster.token)
        client.call("Stats", pb.StatsRequest(), 5)
        client.close()
        client._local.sock = None  # another thread: it holds no connection of its own yet
        with pytest.raises(FastPathError) as e:
            client.call("Stats", pb.StatsRequest(), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "closed" in e.value.details()
        assert client._all == []


def test_a_malformed_request_is_invalid_argument_and_the_connection_lives() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        sock = socket.create_connection(("127.0.0.1", fast_port(cluster)), timeout=5)
        tok = cluster.token.encode()
        sock.sendall(MAGIC + bytes([VERSION]) + struct.pack("<H", len(tok)) + tok)
        assert sock.recv(3)[0] == 0
        sock.sendall(struct.pack("<IB", 3, 0) + b"\xff\xff\xff")  # not a PutStartRequest
        size, status = struct.unpack("<IB", sock.recv(5))
        body = sock.recv(size)
        assert status == 3  # INVALID_ARGUMENT
        assert b"malformed PutStart request" in body
        sock.close()
        good = FastPathClient("127.0.0.1", fast_port(cluster), cluster.token)
        assert good.call("Stats", pb.StatsRequest(), 5)[0].nodes == 0
        good.close()
        assert "Traceback" not in cluster.master.log()  # type: ignore[union-attr]


def test_hostile_sockets_do_not_lock_out_clients() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "16MiB")
        port = fast_port(cluster)
        hostile = []
        for i in range(3 * MAX_UNAUTHENTICATED):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(MAGIC[:2])  # a hello that never completes
            hostile.append(s)
        garbage = socket.create_connection(("127.0.0.1", port), timeout=5)
        garbage.sendall(MAGIC + bytes([VERSION]) + struct.pack("<H", len(cluster.token))
                        + cluster.token.encode())
        garbage.recv(64)
        garbage.sendall(struct.pack("<IB", 1 << 30, 0))  # a frame larger than allowed
        assert garbage.recv(64) == b""  # closed, and the master lives on
        garbage.close()
        with cluster.client() as c:
            t0 = time.monotonic()
            for i in range(20):
                c.put(f"k{i}", b"x" * KiB)
            assert cluster.master_address in c._link._fast
            assert time.monotonic() - t0 < 30
        # The oldest were pushed out by newcomers; the rest are cut at the hello deadline.
        closed = 0
        for s in hostile:
            s.settimeout(10)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
            s.close()
        assert closed == len(hostile)


def test_without_the_fast_path_everything_goes_over_grpc() -> None:
    with StoreCluster() as cluster:
        cluster.start_master("--fast-port", "-1")
        cluster.start_node("a", "16MiB")
        with cluster.client() as c:
            c.put("k", b"v" * KiB)
            assert bytes(c.get("k")) == b"v" * KiB
            assert c._link._fast == {}
