"""Streamed puts (`store.client.streamput`, layer-wise KV) against a real master and nodes on
loopback: what a stream commits is byte for byte what a plain put stores, ranges may arrive in
any order, and a node dying or the lease being lost mid-stream commits nothing (the caller's
plain put then stores it all)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import ObjectExists
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.streamput import StreamFailed, StreamPut
from mooncake_k8s.store.testing import StoreCluster

KiB = 1 << 10
PIECE = 3000  # not a multiple of anything: ranges end at odd offsets


def objects(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 40 * KiB + 17 * i, dtype=np.uint8) for i in range(n)]


def ranges(views: list[np.ndarray]) -> list[tuple[int, int, int]]:
    return [(i, a, min(a + PIECE, len(v))) for i, v in enumerate(views)
            for a in range(0, len(v), PIECE)]


def replicas(c: StoreClient, keys: list[str]) -> list[pb.ObjectReplicas]:
    return list(c._call("GetReplicas", pb.GetReplicasRequest(keys=keys)).objects)


@pytest.fixture
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as cl:
        cl.start_master()
        for n in ("a", "b", "c"):
            cl.start_node(n, "64MiB")
        yield cl


def segment(c: StoreClient, node: str) -> str:
    return next(s.name for s in c.stats().segments if s.node_id == node)


def test_streamed_objects_equal_a_plain_put_in_any_order(cluster: StoreCluster) -> None:
    with cluster.client() as c:
        a, b = segment(c, "a"), segment(c, "b")
        data = objects(6, 1)
        keys = [f"s{i}" for i in range(6)]
        segs = [[a, b]] * 5 + [[b]]  # the last one, like a prompt's tail, on one segment
        put = StreamPut(c, keys, data, segs)
        order = ranges(data)
        random.Random(7).shuffle(order)  # layer writes arriving out of order
        for i, s, e in order:
            put.ready(i, s, e)
        assert put.finish() == [None] * 6
        assert c.batch_put([f"p{i}" for i in range(6)], data) == [None] * 6
        streamed, plain = replicas(c, keys), replicas(c, [f"p{i}" for i in range(6)])
        for i in range(6):
            got = bytes(c.get(keys[i]))  # the read verifies the checksum committed
            assert got == data[i].tobytes() == bytes(c.get(f"p{i}"))
            assert streamed[i].checksum == plain[i].checksum == checksum(got)
            assert streamed[i].size == len(got)
        where = [sorted(r.segment for r in o.replicas) for o in streamed]
        assert where == [sorted([a, b])] * 5 + [[b]]
        # A key stored already is reported as such, and the stream's copy is not published.
        again = StreamPut(c, [keys[0], "fresh"], [data[1], data[2]], [[a]] * 2)
        for i, s, e in ranges([data[1], data[2]]):
            again.ready(i, s, e)
        res = again.finish()
        assert isinstance(res[0], ObjectExists) and res[1] is None
        assert bytes(c.get(keys[0])) == data[0].tobytes()


def test_a_range_never_made_ready_is_never_committed(cluster: StoreCluster) -> None:
    with cluster.client() as c:
        data = objects(2, 2)
        put = StreamPut(c, ["whole", "half"], data, [[segment(c, "a")]] * 2)
        for i, s, e in ranges(data):
            if i == 0 or s < len(data[1]) // 2:
                put.ready(i, s, e)
        res = put.finish()
        assert res[0] is None and isinstance(res[1], StreamFailed)
        assert c.exists(["whole", "half"]) == [True, False]


def test_a_node_dying_mid_stream_commits_nothing(cluster: StoreCluster) -> None:
    # tcp: a same-host shm write would land in the dead node's file without an error
    with cluster.client(transport="tcp") as c:
        a, b = segment(c, "a"), segment(c, "b")
        data = objects(4, 3)
        keys = [f"d{i}" for i in range(4)]
        put = StreamPut(c, keys, data, [[a, b]] * 4)
        order = ranges(data)
        half = len(order) // 2
        for i, s, e in order[:half]:
            put.ready(i, s, e)
        cluster.kill(cluster.nodes["b"])
        for i, s, e in order[half:]:
            put.ready(i, s, e)
        res = put.finish()
        assert all(isinstance(r, StreamFailed) for r in res)
        assert put.error is not None
        assert c.exists(keys) == [False] * 4
        # the fallback: a plain put of the same bytes to what is left
        assert c.batch_put(keys, data, segments=[a, segment(c, "c")]) == [None] * 4
        for k, d in zip(keys, data, strict=True):
            assert bytes(c.get(k)) == d.tobytes()


def test_a_lease_lost_mid_stream_commits_nothing(cluster: StoreCluster) -> None:
    with cluster.client(timeout_s=30) as c:
        a = segment(c, "a")
        c.put("before", b"x" * KiB)
        cluster.wait_inventory(1)
        data = objects(3, 4)
        keys = [f"l{i}" for i in range(3)]
        put = StreamPut(c, keys, data, [[a]] * 3)
        order = ranges(data)
        for i, s, e in order[:3]:
            put.ready(i, s, e)
        cluster.restart_master()  # the new master knows no leases
        for node in cluster.nodes.values():
            cluster.wait_registered(node)
        for i, s, e in order[3:]:
            put.ready(i, s, e)
        res = put.finish()
        assert all(isinstance(r, StreamFailed) for r in res), res
        assert c.exists(keys) == [False] * 3
        assert c.batch_put(keys, data) == [None] * 3
        for k, d in zip(keys, data, strict=True):
            assert bytes(c.get(k)) == d.tobytes()
