"""Space leases on MasterState, with a fake clock: one-round-trip puts and what they may not do."""

from __future__ import annotations

import pytest
from test_metadata import (  # type: ignore[import-not-found]  # (tests/unit/store/)
    Clock,
    KiB,
    drain,
    found,
    make,
    node,
    used,
)

from mooncake_k8s.common.errors import InvalidArgument, NoSpace
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.allocator import ALIGN
from mooncake_k8s.store.master.state import MasterState

MiB = 1 << 20
CMD = pb.NodeCommand


def item(key: str, offset: int, size: int = KiB, checksum: int = 7) -> pb.CommitItem:
    return pb.CommitItem(key=key, offset=offset, size=size, checksum=checksum)


def alloc_of(st: MasterState, name: str):  # type: ignore[no-untyped-def]
    return st._segments[name].alloc


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_commit_publishes_in_one_call_and_tells_the_node(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB, host="h1")
    lease = st.lease_space(64 * KiB, KiB, 1, pb.LOCAL_FIRST, "", "h1")
    assert lease.lease_id and lease.size >= KiB and lease.align == ALIGN
    base = lease.replicas[0].offset
    assert found(st, ["k0"]) == [False]
    resp = st.put_commit(lease.lease_id, [item("k0", 0), item("k1", KiB)])
    assert list(resp.errors) == ["", ""]
    assert found(st, ["k0", "k1"]) == [True, True]
    got = st.get_replicas(["k1"]).response().objects[0]
    assert (got.size, got.checksum, got.replicas[0].offset) == (KiB, 7, base + KiB)
    cmds = [c for c in drain(st, "a") if c.kind == CMD.COMMITTED]
    assert [(c.key, c.offset) for c in cmds] == [("k0", base), ("k1", base + KiB)]


def test_release_frees_exactly_the_unused_rest(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB)
    before = used(st, "a-dram-0")
    lease = st.lease_space(64 * KiB, KiB)
    assert used(st, "a-dram-0") == before + lease.size  # the extent is held while leased
    st.put_commit(lease.lease_id, [item("x", 0, 100), item("y", 3 * KiB, KiB)])
    assert st.space_release(lease.lease_id)
    assert not st.space_release(lease.lease_id)
    # x takes 128 bytes (aligned), y 1 KiB; everything else of the extent is free again.
    assert used(st, "a-dram-0") == before + 128 + KiB
    a = alloc_of(st, "a-dram-0")
    a.check()
    assert a.allocations == 2
    st.remove(["x", "y"], force=True)
    assert used(st, "a-dram-0") == before and a.allocations == 0
    a.check()


def test_commit_with_release_ends_the_lease(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB)
    lease = st.lease_space(64 * KiB, KiB)
    assert list(st.put_commit(lease.lease_id, [item("k", 0)], release=True).errors) == [""]
    assert st.counters()["space_leases"] == 0
    assert used(st, "a-dram-0") == KiB
    again = st.put_commit(lease.lease_id, [item("j", 2 * KiB)])
    assert list(again.codes) == [pb.ERROR_NOT_FOUND]


def test_bad_commits_are_refused_one_by_one(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB)
    lease = st.lease_space(16 * KiB, KiB)
    n = lease.size
    resp = st.put_commit(lease.lease_id, [
        item("ok", 0, 2 * KiB),
        item("overlap", KiB),            # inside "ok"'s range
        item("unaligned", 2 * KiB + 1),
        item("outside", n - 64, 128),    # runs past the extent
        item("empty", 4 * KiB, 0),
        item("", 5 * KiB),
        item("ok2", 6 * KiB),
    ])
    bad = pb.ERROR_INVALID
    assert list(resp.codes) == [pb.ERROR_NONE, bad, bad, bad, bad, bad, pb.ERROR_NONE]
    assert "overlaps" in resp.errors[1] and "aligned part" in resp.errors[2]
    assert found(st, ["ok", "overlap", "ok2"]) == [True, False, True]
    # A committed range stays taken even after its object is gone: no second object there.
    st.remove(["ok"], force=True)
    assert list(st.put_commit(lease.lease_id, [item("again", 0)]).codes) == [pb.ERROR_INVALID]


def test_existing_key_is_refused_and_its_range_freed_at_the_end(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB)
    first = st.lease_space(16 * KiB, KiB)
    st.put_commit(first.lease_id, [item("k", 0, KiB, 1)], release=True)
    second = st.lease_space(16 * KiB, KiB)
    resp = st.put_commit(second.lease_id, [item("k", 0, KiB, 2)], release=True)
    assert list(resp.codes) == [pb.ERROR_EXISTS]
    assert st.get_replicas(["k"]).response().objects[0].checksum == 1
    assert used(st, "a-dram-0") == KiB
    alloc_of(st, "a-dram-0").check()


def test_unknown_lease_is_not_found_for_every_item(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=8 * MiB)
    resp = st.put_commit(12345, [item("a", 0), item("b", KiB)])
    assert list(resp.codes) == [pb.ERROR_NOT_FOUND] * 2
    assert "put again" in resp.errors[0]


def test_idle_lease_expires_and_use_keeps_it(clock: Clock) -> None:
    st = make(clock, space_ttl_s=5.0)
    node(st, "a", dram=8 * MiB)
    lease = st.lease_space(64 * KiB, KiB)
    clock.advance(4)
    st.put_commit(lease.lease_id, [item("k", 0)])
    clock.advance(4)
    st.tick()  # 8 s after the grant but 4 after its last use: still there
    assert st.counters()["space_leases"] == 1
    clock.advance(2)
    st.tick()
    assert st.counters()["space_leases"] == 0
    assert used(st, "a-dram-0") == KiB
    assert list(st.put_commit(lease.lease_id, [item("j", KiB)]).codes) == [pb.ERROR_NOT_FOUND]


def test_node_restart_cancels_its_leases_and_frees_other_replicas_gaps(clock: Clock) -> None:
    st = make(clock)
    a_seg = [pb.SegmentInfo(name="a-dram-0", tier=pb.DRAM, size=8 * MiB, path="/dev/shm/a")]
    st.register_node("a", "127.0.0.1:7001", "h0", a_seg, [], "inc-1")
    node(st, "b", dram=8 * MiB)
    lease = st.lease_space(64 * KiB, KiB, replicas=2)
    assert {r.node_id for r in lease.replicas} == {"a", "b"}
    st.put_commit(lease.lease_id, [item("k", 0)])
    # a restarts empty (new incarnation, nothing in its inventory)
    st.register_node("a", "127.0.0.1:7001", "h0", a_seg, [], "inc-2")
    assert st.counters()["space_leases"] == 0
    assert list(st.put_commit(lease.lease_id, [item("j", KiB)]).codes) == [pb.ERROR_NOT_FOUND]
    assert used(st, "b-dram-0") == KiB  # only k's replica on b is left
    alloc_of(st, "b-dram-0").check()
    alloc_of(st, "a-dram-0").check()


def test_grant_is_capped_and_never_evicts_for_its_slack(clock: Clock) -> None:
    st = make(clock, high_watermark=0.875, low_watermark=0.5)
    node(st, "a", dram=4 * MiB)
    lease = st.lease_space(1 << 30, KiB)
    assert lease.size == 4 * MiB // 64  # a share of the segment, not the whole GiB
    st.space_release(lease.lease_id)
    # Fill the segment to its high watermark, then ask again: the slack is not worth
    # evicting cached objects for, so the grant shrinks to what the writer needs now, and
    # only that much is evicted.
    big = st.lease_space(3 * MiB + 512 * KiB, 3 * MiB + 512 * KiB)
    st.put_commit(big.lease_id, [item(f"o{i}", i * 512 * KiB, 512 * KiB) for i in range(7)],
                  release=True)
    small = st.lease_space(MiB, 8 * KiB)
    assert small.size == 8 * KiB
    assert found(st, [f"o{i}" for i in range(7)]).count(True) == 6


def test_lease_arguments_are_checked(clock: Clock) -> None:
    st = make(clock)
    with pytest.raises(NoSpace):
        st.lease_space(KiB)  # no segments at all
    node(st, "a", dram=8 * MiB)
    with pytest.raises(InvalidArgument):
        st.lease_space(KiB, 2 * KiB)
    with pytest.raises(InvalidArgument):
        st.lease_space(KiB, replicas=99)
    with pytest.raises(NoSpace):
        st.lease_space(KiB, replicas=2)  # one node only
