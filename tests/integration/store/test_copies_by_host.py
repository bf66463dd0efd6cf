"""Copies placed by host (issue 20 item 2), on a real master process and real storage nodes.

The nodes run in this test's process with host ids of their own ("hA", "hB", "hC"), the way
workers serve a segment on their own host; a client built with `host_id=` is then "on" that
host: its replicas there are read through shared memory, the others over TCP.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from mooncake_k8s.common.errors import InvalidArgument, StoreError
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import HaStoreCluster, StoreCluster, start_host_node

MiB = 1 << 20
EV = pb.BlockEvent
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


@pytest.fixture
def bed() -> Iterator[Bed]:
    with StoreCluster() as cluster:
        cluster.start_master()
        nodes = {n: start_host_node(cluster, n, h, 8 * MiB) for n, h in HOSTS.items()}
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


def test_two_named_segments_of_one_node_go_to_distinct_nodes(bed: Bed) -> None:
    node = StorageNode(NodeConfig(master=bed.cluster.master_address, node_id="nd",
                                  token=bed.cluster.token, dram_size=8 * MiB, dram_segments=2,
                                  host_id="hD", prefault=False))
    node.start()
    try:
        assert node.wait_registered(20)
        with bed.client("hA") as c:
            c.put("pair", b"q" * 4000, segments=["nd-dram-0", "nd-dram-1"])
            got = bed.replicas("pair")
            assert len(got) == 2 and "nd-dram-0" in got and "nd-dram-1" not in got
            assert [s for s in got if s != "nd-dram-0"] == ["na-dram-0"]  # then local first
    finally:
        node.stop()


def test_segments_lists_every_segment_with_its_host(bed: Bed) -> None:
    with bed.client("hA") as c:
        c.put("k", b"z" * 1000, segments=["nb-dram-0"])
        segs = {s.name: s for s in c.segments()}
    assert {n: (s.node_id, s.host_id, s.tier) for n, s in segs.items()} == {
        f"{n}-dram-0": (n, h, "dram") for n, h in HOSTS.items()}
    assert segs["nb-dram-0"].used >= 1000 and segs["na-dram-0"].used == 0
    assert segs["na-dram-0"].size == 8 * MiB


def served_bytes(node: StorageNode) -> float:
    """Bytes the node's transfer server sent (reads over TCP; shared memory bypasses it)."""
    return node.registry.get_sample_value("mooncake_node_transfer_bytes_total",
                                          {"direction": "out"}) or 0.0


class Watcher:
    """The master's block events, collected by a thread from a Watch stream."""

    def __init__(self, bed: Bed) -> None:
        self.client = bed.cluster.client()
        self.events: list[tuple[int, str, str]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.2)  # the stream is open once the master answered its first message

    def _run(self) -> None:
        with contextlib.suppress(StoreError):
            for ev in self.client.watch():
                self.events.append((ev.kind, ev.key, ev.segment))

    def wait_for(self, wanted: tuple[int, str, str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while wanted not in self.events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert wanted in self.events, self.events

    def close(self) -> None:
        self.client.close()
        self._thread.join(timeout=5)


def test_keep_on_adds_a_replica_here_and_the_next_read_is_local(bed: Bed) -> None:
    payload = bytes(range(256)) * 64
    watcher = Watcher(bed)
    try:
        with bed.client("hA") as writer, bed.client("hB") as reader:
            writer.put("hot", payload, segments=["na-dram-0"])
            buf = bytearray(len(payload))
            sent = served_bytes(bed.nodes["na"])
            assert reader.batch_get_into(["hot"], [buf], keep_on="nb-dram-0") == [len(payload)]
            assert bytes(buf) == payload
            assert (reader.remote_reads, reader.kept_blocks, reader.keep_failures) == (1, 1, 0)
            assert served_bytes(bed.nodes["na"]) == sent + len(payload)  # over TCP, once
            assert bed.replicas("hot") == ["na-dram-0", "nb-dram-0"]
            watcher.wait_for((EV.STORED, "hot", "nb-dram-0"))
            again = bytearray(len(payload))
            assert reader.batch_get_into(["hot"], [again], keep_on="nb-dram-0") == [len(payload)]
            assert bytes(again) == payload
            assert (reader.local_reads, reader.remote_reads, reader.kept_blocks) == (1, 1, 1)
            assert served_bytes(bed.nodes["na"]) == sent + len(payload)  # not from A again
            with bed.client("hB") as other:  # another reader on B, fresh from the master
                assert bytes(other.get("hot")) == payload and other.local_reads == 1
            # the kept replica leaves on its own: one event, for its segment only
            reader.remove(["hot"])
            watcher.wait_for((EV.REMOVED, "hot", "nb-dram-0"))
            watcher.wait_for((EV.REMOVED, "hot", "na-dram-0"))
    finally:
        watcher.close()


def test_keep_later_keeps_in_the_background_until_wait_kept(bed: Bed) -> None:
    """A prefill reads a prefix from another host and computes while it is kept: the read
    returns with the bytes, and after `wait_kept` the replica is on the reader's host."""
    payload = bytes(range(200)) * 80
    with bed.client("hA") as writer, bed.client("hB") as reader:
        writer.batch_put(["bg1", "bg2"], [payload, payload[::-1]], segments=["na-dram-0"])
        bufs = [bytearray(len(payload)), bytearray(len(payload))]
        got = reader.batch_get_into(["bg1", "bg2"], bufs, keep_on="nb-dram-0", keep_later=True)
        assert got == [len(payload)] * 2
        assert bytes(bufs[0]) == payload and bytes(bufs[1]) == payload[::-1]
        reader.wait_kept()
        assert (reader.kept_blocks, reader.keep_failures) == (2, 0)
        assert bed.replicas("bg1") == ["na-dram-0", "nb-dram-0"]
        assert bed.replicas("bg2") == ["na-dram-0", "nb-dram-0"]
        reader.wait_kept()  # nothing pending: returns at once


def test_keep_on_never_evicts_and_never_fails_the_read(bed: Bed) -> None:
    payload = b"p" * 100_000
    with bed.client("hA", space_lease_bytes=0) as writer, bed.client("hB") as reader:
        writer.put("cold", payload, segments=["na-dram-0"])
        seg_b = next(s for s in reader.segments() if s.name == "nb-dram-0")
        # B's own objects fill it to 50 KB under its high watermark (0.95): no room for 100 KB
        writer.put("filler", b"f" * (int(0.95 * seg_b.size) - seg_b.used - 50_000),
                   segments=["nb-dram-0"])
        assert bed.replicas("filler") == ["nb-dram-0"]
        objects, evictions = reader.stats().objects, reader.stats().evictions
        buf = bytearray(len(payload))
        assert reader.batch_get_into(["cold"], [buf], keep_on="nb-dram-0") == [len(payload)]
        assert bytes(buf) == payload
        assert (reader.kept_blocks, reader.keep_failures) == (0, 1)
        assert "never evicts" in reader.last_keep_error
        assert (reader.stats().objects, reader.stats().evictions) == (objects, evictions)
        assert bed.replicas("cold") == ["na-dram-0"]


def test_keep_on_bad_names_are_counted_not_raised(bed: Bed) -> None:
    with bed.client("hA") as writer, bed.client("hC") as reader:
        writer.put("k", b"k" * 3000, segments=["na-dram-0"])
        buf = bytearray(3000)
        assert reader.batch_get_into(["k"], [buf], keep_on="no-such-segment") == [3000]
        assert reader.keep_failures == 1 and "not registered" in reader.last_keep_error
        assert reader.batch_get_into(["k"], [buf]) == [3000]  # keep_on="" keeps nothing
        # named where a replica is already: skipped, nothing added
        assert reader.batch_get_into(["k"], [buf], keep_on="na-dram-0") == [3000]
        assert (reader.kept_blocks, reader.keep_skipped, reader.keep_failures) == (0, 1, 1)
        assert bed.replicas("k") == ["na-dram-0"]
        with pytest.raises(InvalidArgument, match="keep_on"):
            reader.batch_get_into(["k"], [buf], keep_on=None)  # type: ignore[arg-type]


def test_a_kept_replica_survives_a_master_restart(bed: Bed) -> None:
    with bed.client("hA") as writer, bed.client("hB") as reader:
        writer.put("durable", b"d" * 5000, segments=["na-dram-0"])
        buf = bytearray(5000)
        assert reader.batch_get_into(["durable"], [buf], keep_on="nb-dram-0") == [5000]
        assert reader.kept_blocks == 1
        node_b = bed.nodes["nb"]
        deadline = time.monotonic() + 10  # the node learns of it from the command stream
        while (not any(k == "durable" for k, _ in node_b.inventory.values())
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert any(k == "durable" for k, _ in node_b.inventory.values())
    bed.cluster.restart_master()
    bed.cluster.wait_nodes(len(bed.nodes))
    assert bed.replicas("durable") == ["na-dram-0", "nb-dram-0"]
    with bed.client("hB") as reader:
        assert bytes(reader.get("durable")) == b"d" * 5000 and reader.local_reads == 1


def test_a_kept_replica_survives_an_ha_failover_at_once() -> None:
    """Two masters on a real Redis: the leader journals the added replica before it answers,
    so killing it right after the keep (the node may not have heard of it yet) loses nothing."""
    with HaStoreCluster() as cluster:
        cluster.start_masters()
        nodes = {n: start_host_node(cluster, n, h, 8 * MiB) for n, h in HOSTS.items() if n != "nc"}
        try:
            cluster.wait_nodes(len(nodes))
            bed = Bed(cluster, nodes)
            with bed.client("hA") as writer, bed.client("hB") as reader:
                writer.put("ha", b"h" * 7000, segments=["na-dram-0"])
                buf = bytearray(7000)
                assert reader.batch_get_into(["ha"], [buf], keep_on="nb-dram-0") == [7000]
                assert reader.kept_blocks == 1
                name, leader = cluster.leader()
                cluster.kill(leader)  # SIGKILL: no goodbye
                others = [n for n in cluster.masters if n != name]
                assert cluster.leader()[0] in others
                cluster.wait_nodes(len(nodes))
                assert bed.replicas("ha") == ["na-dram-0", "nb-dram-0"]
        finally:
            for n in nodes.values():
                n.stop()
