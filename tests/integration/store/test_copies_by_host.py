"""Copies placed by host (issue 20 item 2), on a real master process and real storage nodes.

The nodes run in this test's process with host ids of their own ("hA", "hB", "hC"), the way
workers serve a segment on their own host; a client built with `host_id=` is then "on" that
host: its replicas there are read through shared memory, the others over TCP.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import StoreCluster

MiB = 1 << 20
HOSTS = {"na": "hA", "nb": "hB", "nc": "hC"}


class Bed:
    def __init__(self, cluster: StoreCluster, nodes: dict[str, StorageNode]) -> None:
        self.cluster = cluster
        self.nodes = nodes

    def client(self, host: str, **kw: object) -> StoreClient:
        return self.cluster.client(host_id=host, **kw)

    def replicas(self, key: str) -> list[str]:
        """The segments GetReplicas lists for `key` (sorted)."""
        with self.cluster.client(location_cache=False) as c:
            got = c._lookup([key], use_cache=False)[0]
        return sorted(loc.segment.name for loc in got.replicas) if got else []


def start_node(cluster: StoreCluster, node_id: str, host: str, size: int) -> StorageNode:
    node = StorageNode(NodeConfig(master=cluster.master_address, node_id=node_id,
                                  token=cluster.token, dram_size=size, host_id=host,
                                  prefault=False))
    node.start()
    assert node.wait_registered(20)
    return node


@pytest.fixture
def bed() -> Iterator[Bed]:
    with StoreCluster() as cluster:
        cluster.start_master()
        nodes = {n: start_node(cluster, n, h, 8 * MiB) for n, h in HOSTS.items()}
        try:
            cluster.wait_nodes(len(nodes))
            yield Bed(cluster, nodes)
        finally:
            for n in nodes.values():
                n.stop()


@pytest.mark.parametrize("lease_bytes", [0, 1 * MiB], ids=["classic", "space-lease"])
def test_segments_put_one_replica_on_each_named_segment(bed: Bed, lease_bytes: int) -> None:
    with bed.client("hA", space_lease_bytes=lease_bytes) as c:
        c.put("two", b"x" * 5000, segments=["nc-dram-0", "nb-dram-0"])
        assert bed.replicas("two") == ["nb-dram-0", "nc-dram-0"]
        errs = c.batch_put(["b0", "b1"], [b"a" * 100, b"b" * 200], segments=["nb-dram-0"])
        assert errs == [None, None]
        assert bed.replicas("b0") == bed.replicas("b1") == ["nb-dram-0"]
        # an unknown name falls back to placement (local first: the client's host)
        c.put("fallback", b"y" * 300, segments=["no-such-segment"])
        assert bed.replicas("fallback") == ["na-dram-0"]
        assert bytes(c.get("two")) == b"x" * 5000


def test_segments_lists_every_segment_with_its_host(bed: Bed) -> None:
    with bed.client("hA") as c:
        c.put("k", b"z" * 1000, segments=["nb-dram-0"])
        segs = {s.name: s for s in c.segments()}
    assert {n: (s.node_id, s.host_id, s.tier) for n, s in segs.items()} == {
        f"{n}-dram-0": (n, h, "dram") for n, h in HOSTS.items()}
    assert segs["nb-dram-0"].used >= 1000 and segs["na-dram-0"].used == 0
    assert segs["na-dram-0"].size == 8 * MiB
