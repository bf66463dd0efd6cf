"""One master round trip per put (space leases) with real master and node processes: counted at
the master, every byte read back, and a lost lease never loses a put."""

from __future__ import annotations

import threading

import pytest

from mooncake_k8s.common.errors import ObjectExists
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.testing import StoreCluster, metric_value

KiB = 1 << 10
MiB = 1 << 20
RPC = "mooncake_master_rpc_seconds_count"


def calls(cluster: StoreCluster, method: str) -> float:
    assert cluster.master is not None
    return metric_value(cluster.master.metrics(), RPC, f'method="{method}"')


def blob(i: int, size: int = 64 * KiB) -> bytes:
    return bytes([i % 251]) * (size - 1) + bytes([(i * 7) % 256])


def test_each_put_is_one_master_call_after_the_first() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "256MiB")
        with cluster.client() as c:
            for i in range(40):
                c.put(f"k{i}", blob(i))
            errs = c.batch_put([f"b{i}" for i in range(16)], [blob(i) for i in range(16)])
            assert errs == [None] * 16
            assert calls(cluster, "PutCommit") == 41  # one per put, one for the whole batch
            assert calls(cluster, "SpaceLease") == 1  # 56 x 64 KiB fit one 4 MiB extent
            assert calls(cluster, "PutStart") + calls(cluster, "BatchPutStart") == 0
            for i in range(40):
                assert bytes(c.get(f"k{i}")) == blob(i)
            got = [bytearray(64 * KiB) for _ in range(16)]
            assert c.batch_get_into([f"b{i}" for i in range(16)], got) == [64 * KiB] * 16
            assert [bytes(g) for g in got] == [blob(i) for i in range(16)]
            with pytest.raises(ObjectExists):
                c.put("k3", blob(3))
            stats = c.stats()
            assert stats.objects == 56
        # The client released its extent on close: only the objects' bytes stay allocated.
        with cluster.client(space_lease_bytes=0) as plain:
            used = sum(s.used for s in plain.stats().segments)
            assert used == 56 * 64 * KiB


def test_concurrent_writers_share_extents_without_overlap() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "128MiB")
        cluster.start_node("b", "128MiB")
        with cluster.client(space_lease_bytes=2 * MiB) as c:
            def writer(t: int) -> None:
                for i in range(30):  # 8 x 30 x 48 KiB: several extents, retired under load
                    c.put(f"t{t}-{i}", blob(t * 100 + i, 48 * KiB), replicas=2)

            threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            for t in range(8):
                for i in range(30):
                    assert bytes(c.get(f"t{t}-{i}")) == blob(t * 100 + i, 48 * KiB)
            reps = c._call("GetReplicas", pb.GetReplicasRequest(keys=["t0-0", "t7-29"]))
            assert all(len(o.replicas) == 2 for o in reps.objects)
            assert calls(cluster, "PutStart") == 0
            assert calls(cluster, "SpaceLease") >= 6  # 11 MiB through 2 MiB extents


def test_a_lease_lost_to_a_master_restart_falls_back_and_loses_nothing() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        node = cluster.start_node("a", "64MiB")
        with cluster.client(timeout_s=30) as c:
            c.put("before", blob(1))
            cluster.wait_inventory(1)  # (an embedded master's commits live in its nodes)
            cluster.restart_master()
            cluster.wait_registered(node)
            # The new master knows no leases: the commit is refused as NOT_FOUND and the put
            # goes again through PutStart/PutEnd, which the new master counts.
            c.put("after", blob(2))
            assert calls(cluster, "PutCommit") == 1  # refused, then a fresh extent is not
            assert calls(cluster, "PutEnd") == 1  # taken for this put: classic (its PutStart
            assert calls(cluster, "PutStart") >= 1  # may be refused while the master recovers)
            c.put("later", blob(3))  # and the next put leases again
            assert calls(cluster, "SpaceLease") == 1
            for k, i in (("before", 1), ("after", 2), ("later", 3)):
                assert bytes(c.get(k)) == blob(i)


def test_big_and_most_free_puts_take_the_classic_path() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "256MiB")
        cluster.start_node("b", "256MiB")
        with cluster.client() as c:
            for i in range(6):
                c.put(f"spread{i}", blob(i), placement="most_free")
            c.put("big", b"x" * (65 * MiB))
            assert calls(cluster, "SpaceLease") == 0
            assert calls(cluster, "PutStart") == 7
            nodes = {r.node_id for o in c._call("GetReplicas", pb.GetReplicasRequest(
                keys=[f"spread{i}" for i in range(6)])).objects for r in o.replicas}
            assert nodes == {"a", "b"}


def test_refusals_name_their_error_code_on_both_paths() -> None:
    """One typed error enum on the wire: the `mooncake-error` trailer, not message text, decides
    the client's exception (gRPC and the fast path alike)."""
    from mooncake_k8s.common.errors import ObjectTooLarge
    from mooncake_k8s.store.client.fastpath import FastPathClient, FastPathError
    from mooncake_k8s.store.client.masterlink import trailers_of
    from mooncake_k8s.store.wire import ERROR_KEY

    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "16MiB")
        with cluster.client() as c:
            with pytest.raises(ObjectTooLarge):
                c.put("huge", b"x" * (17 * MiB))  # larger than any segment
            c.put("small", b"x")  # a gRPC answer names the fast port
            port = c._link._fast[cluster.master_address].port
        fast = FastPathClient("127.0.0.1", port, cluster.token)
        with pytest.raises(FastPathError) as e:
            fast.call("PutStart", pb.PutStartRequest(key="big", size=1 << 40), 5)
        assert trailers_of(e.value)[ERROR_KEY] == "ERROR_TOO_LARGE"
        with pytest.raises(FastPathError) as e:
            fast.call("PutEnd", pb.PutEndRequest(key="k", put_id=1, checksum=1), 5)
        assert trailers_of(e.value)[ERROR_KEY] == "ERROR_NOT_FOUND"
        fast.close()
