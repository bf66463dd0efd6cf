"""Copies placed by host: `segments` on puts and space leases (MasterState, fake clock)."""

from __future__ import annotations

import pytest
from test_metadata import (  # type: ignore[import-not-found]  # (tests/unit/store/)
    Clock,
    KiB,
    make,
    node,
    seg,
    used,
)

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.state import MasterState


@pytest.fixture
def clock() -> Clock:
    return Clock()


def cluster(clock: Clock, n: int = 4, dram: int = 64 * KiB) -> MasterState:
    st: MasterState = make(clock)
    for i in range(n):
        node(st, f"n{i}", dram=dram, host=f"h{i}")
    return st


def segs_of(r: pb.PutStartResponse | pb.SpaceLeaseResponse) -> list[str]:
    return [x.segment for x in r.replicas]


def test_one_replica_on_each_named_segment_in_order(clock: Clock) -> None:
    st = cluster(clock)
    r = st.put_start("k", KiB, 1, pb.LOCAL_FIRST, "", "h0", ["n2-dram-0", "n3-dram-0"])
    assert segs_of(r) == ["n2-dram-0", "n3-dram-0"]  # replicas = max(1, 2), named ones first
    st.put_end("k", r.put_id, 5)
    got = st.get_replicas(["k"]).response().objects[0]
    assert sorted(x.segment for x in got.replicas) == ["n2-dram-0", "n3-dram-0"]
    assert [s.host_id for s in st.stats().segments] == ["h0", "h1", "h2", "h3"]


def test_more_replicas_than_names_fill_by_placement(clock: Clock) -> None:
    st = cluster(clock)
    r = st.put_start("k", KiB, 3, pb.LOCAL_FIRST, "", "h1", ["n3-dram-0"])
    assert segs_of(r)[0] == "n3-dram-0" and segs_of(r)[1] == "n1-dram-0"  # then local first
    assert len({x.node_id for x in r.replicas}) == 3


def test_unknown_or_same_node_names_are_replaced_on_unused_nodes(clock: Clock) -> None:
    st = make(clock)
    st.register_node("a", "127.0.0.1:7001", "ha", [seg("a-dram-0", 64 * KiB),
                                                   seg("a-dram-1", 64 * KiB)])
    node(st, "b", host="hb")
    r = st.put_start("k", KiB, 1, pb.LOCAL_FIRST, "", "", ["a-dram-0", "a-dram-1"])
    assert segs_of(r)[0] == "a-dram-0" and r.replicas[1].node_id == "b"  # distinct nodes
    r = st.put_start("u", KiB, 1, pb.LOCAL_FIRST, "", "hb", ["nowhere", "a-dram-1"])
    assert sorted(segs_of(r)) == ["a-dram-1", "b-dram-0"]


def test_names_beyond_the_nodes_do_not_fail_the_put(clock: Clock) -> None:
    """The replicas the names add are placed where distinct nodes allow; only `replicas`
    is required."""
    st = make(clock)
    st.register_node("a", "127.0.0.1:7001", "ha", [seg("a-dram-0", 64 * KiB),
                                                   seg("a-dram-1", 64 * KiB)])
    r = st.put_start("k", KiB, 1, pb.LOCAL_FIRST, "", "", ["a-dram-0", "a-dram-1"])
    assert segs_of(r) == ["a-dram-0"]


def test_full_named_segment_evicts_its_lru_like_any_put_there(clock: Clock) -> None:
    st = cluster(clock, n=2, dram=16 * KiB)
    for i in range(15):  # fill n1 to its high watermark (0.95)
        r = st.put_start(f"old{i}", KiB, 1, pb.PREFERRED, "n1-dram-0")
        assert segs_of(r) == ["n1-dram-0"]
        st.put_end(f"old{i}", r.put_id, 1)
    before = used(st, "n1-dram-0")
    r = st.put_start("new", KiB, 1, pb.LOCAL_FIRST, "", "h0", ["n1-dram-0"])
    assert segs_of(r) == ["n1-dram-0"] and used(st, "n1-dram-0") == before  # one evicted
    assert st.exists(["old0"])[0] == [False]


def test_named_segment_that_cannot_take_it_is_replaced(clock: Clock) -> None:
    st = cluster(clock, n=2, dram=16 * KiB)
    lk = []
    for i in range(15):
        r = st.put_start(f"old{i}", KiB, 1, pb.PREFERRED, "n1-dram-0")
        st.put_end(f"old{i}", r.put_id, 1)
        lk.append(f"old{i}")
    st.get_replicas(lk, lease_ms=60_000)  # leased: nothing there may be evicted
    r = st.put_start("new", KiB, 1, pb.LOCAL_FIRST, "", "h0", ["n1-dram-0"])
    assert segs_of(r) == ["n0-dram-0"]


def test_space_lease_puts_its_extent_on_the_named_segments(clock: Clock) -> None:
    st = cluster(clock, n=3, dram=1 << 20)
    lease = st.lease_space(64 * KiB, KiB, 1, pb.LOCAL_FIRST, "", "h0",
                           ["n2-dram-0", "n1-dram-0"])
    assert segs_of(lease) == ["n2-dram-0", "n1-dram-0"] and lease.size > KiB
    r = st.put_commit(lease.lease_id, [pb.CommitItem(key="k", offset=0, size=KiB, checksum=3)])
    assert list(r.codes) == [pb.ERROR_NONE]
    got = st.get_replicas(["k"]).response().objects[0]
    assert sorted(x.segment for x in got.replicas) == ["n1-dram-0", "n2-dram-0"]


def test_too_many_names_is_invalid(clock: Clock) -> None:
    st = cluster(clock)
    with pytest.raises(InvalidArgument, match="segments"):
        st.put_start("k", KiB, 1, pb.LOCAL_FIRST, "", "", [f"s{i}" for i in range(9)])
    out = st.batch_put_start([pb.PutStartRequest(key="k", size=KiB,
                                                 segments=[f"s{i}" for i in range(9)])])
    assert out[0].code == pb.ERROR_INVALID
