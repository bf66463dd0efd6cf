"""Hot-object fan-out (issue 22 item 1) on a real master process and real storage nodes.

The nodes run in this test's process on emulated hosts ("hA", "hB", "hC"); a client built with
`host_id=` is "on" that host. An object stored on hA and read often from hB and hC gains a
replica on each of those hosts, copied node to node (the reader's node reads it from hA's node
through the transfer engine); readers then read it from their own host; once the reads stop
the extra replicas are the first evicted when their segment needs room.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from mooncake_k8s.store.node.server import StorageNode
from mooncake_k8s.store.testing import StoreCluster, metric_value, start_host_node

KiB = 1 << 10
MiB = 1 << 20
HOSTS = {"na": "hA", "nb": "hB", "nc": "hC"}
WINDOW_S = 2.0
LEASE_MS = 200  # reads' leases end well within a window (a leased replica is never evicted)
SIZE = 64 * KiB
HOT = bytes(range(256)) * (SIZE // 256)


class Bed:
    def __init__(self, cluster: StoreCluster, nodes: dict[str, StorageNode]) -> None:
        self.cluster = cluster
        self.nodes = nodes

    def replicas(self, key: str) -> list[str]:
        """The segments GetReplicas lists for `key` (sorted; asked from no host)."""
        with self.cluster.client(location_cache=False, lease_ms=LEASE_MS) as c:
            got = c._lookup([key], use_cache=False)[0]
        return sorted(loc.segment.name for loc in got.replicas) if got else []

    def metric(self, labels: str) -> float:
        master = self.cluster.master
        assert master is not None, "the cluster's master is not running"
        return metric_value(master.metrics(), "mooncake_store_fanout_replicas_total", labels)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


@pytest.fixture
def bed() -> Iterator[Bed]:
    with StoreCluster() as cluster:
        cluster.start_master("--fanout", "--fanout-threshold", "2", "--fanout-window",
                             str(WINDOW_S), "--fanout-max-replicas", "3")
        nodes = {n: start_host_node(cluster, n, h, 2 * MiB) for n, h in HOSTS.items()}
        try:
            cluster.wait_nodes(len(nodes))
            yield Bed(cluster, nodes)
        finally:
            for n in nodes.values():
                n.stop()


def test_fanout_adds_replicas_near_readers_and_drops_them_first_once_cool(bed: Bed) -> None:
    c = bed.cluster
    with c.client(host_id="hA", space_lease_bytes=0) as a, \
            c.client(host_id="hB", location_cache=False, lease_ms=LEASE_MS) as b, \
            c.client(host_id="hC", location_cache=False, lease_ms=LEASE_MS) as cc:
        # hB's own objects, older than any fan-out copy (classic puts: a put named to a full
        # segment evicts there; a space lease would go elsewhere instead)
        old = [f"old{i}" for i in range(20)]
        assert a.batch_put(old, [bytes([i]) * SIZE for i in range(20)],
                           segments=["nb-dram-0"]) == [None] * 20
        a.put("hot", HOT, segments=["na-dram-0"])
        assert bed.replicas("hot") == ["na-dram-0"]

        # Reads from hB and hC (2 per window is the threshold) add a replica on each host.
        def read_from_b_and_c() -> bool:
            assert bytes(b.get("hot")) == HOT and bytes(cc.get("hot")) == HOT
            return bed.replicas("hot") == ["na-dram-0", "nb-dram-0", "nc-dram-0"]
        wait_for(read_from_b_and_c, "fan-out replicas on hB and hC")
        assert bed.metric('event="added"') == 2

        # Readers now read from their own host (shared memory), with the right bytes.
        b.local_reads = b.remote_reads = cc.local_reads = cc.remote_reads = 0
        for reader in (b, cc):
            for _ in range(3):
                buf = bytearray(SIZE)
                assert reader.batch_get_into(["hot"], [buf]) == [SIZE] and bytes(buf) == HOT
        assert (b.local_reads, b.remote_reads) == (3, 0)
        assert (cc.local_reads, cc.remote_reads) == (3, 0)

        # Reads stop; after a window the extra replicas are cool (and their read leases over).
        # Filling hB's segment past its high watermark evicts the cool extra replica first:
        # the older objects stay.
        time.sleep(WINDOW_S + 0.3)
        new = [f"new{i}" for i in range(10)]  # 31 objects: one over the high watermark
        assert a.batch_put(new, [b"n" * SIZE] * 10, segments=["nb-dram-0"]) == [None] * 10
        assert all(bed.replicas(k) == ["nb-dram-0"] for k in new)
        assert bed.replicas("hot") == ["na-dram-0", "nc-dram-0"]
        assert all(bed.replicas(k) == ["nb-dram-0"] for k in old)
        assert bed.metric('event="dropped"') == 1
        assert bytes(b.get("hot")) == HOT  # still readable, from another host
