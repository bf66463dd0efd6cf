"""A replica added to a stored object (hot-block replication), on MasterState with a fake clock:
ReplicaStart allocates from free room only, ReplicaEnd checks the bytes and adds the replica,
and the added replica then lives like any other (events, eviction, removal, restarts)."""

from __future__ import annotations

import pytest
from test_metadata import (  # type: ignore[import-not-found]  # (tests/unit/store/)
    Clock,
    KiB,
    drain,
    make,
    seg,
    used,
)

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.state import MasterState

EV = pb.BlockEvent
CMD = pb.NodeCommand
SUM = 0xABC


@pytest.fixture
def clock() -> Clock:
    return Clock()


def register(st: MasterState, node_id: str, host: str, dram: int = 64 * KiB,
             incarnation: str = "1", inventory: list[pb.InventoryItem] | None = None) -> int:
    return st.register_node(node_id, f"127.0.0.1:{7000 + len(node_id)}", host,
                            [seg(f"{node_id}-dram-0", dram)], inventory or [],
                            incarnation).restored


def two_hosts(clock: Clock, **kw: object) -> MasterState:
    st: MasterState = make(clock, **kw)
    register(st, "a", "hA")
    register(st, "b", "hB")
    return st


def put_on(st: MasterState, key: str, segment: str, size: int = KiB) -> None:
    r = st.put_start(key, size, 1, pb.LOCAL_FIRST, "", "", [segment])
    assert [x.segment for x in r.replicas] == [segment]
    st.put_end(key, r.put_id, SUM)


def add(st: MasterState, key: str, segment: str, checksum: int = SUM) -> tuple[int, str]:
    """Start and end one added replica: (ReplicaEnd code, error)."""
    res = st.replica_start([key], segment)[0]
    assert res.code == pb.ERROR_NONE, res.error
    resp, _ = st.replica_end([pb.ReplicaEndItem(key=key, replica_id=res.replica_id,
                                                checksum=checksum)])
    return resp.codes[0], resp.errors[0]


def segments_of(st: MasterState, key: str) -> list[str]:
    obj = st.get_replicas([key]).response().objects[0]
    return sorted(r.segment for r in obj.replicas)


def test_added_replica_joins_its_object_with_a_stored_event(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    drain(st, "b")
    events = st.subscribe()
    res = st.replica_start(["k"], "b-dram-0")[0]
    assert (res.size, res.checksum, res.replica.segment, res.replica.host_id) == (
        KiB, SUM, "b-dram-0", "hB")
    assert segments_of(st, "k") == ["a-dram-0"]  # invisible until it ends
    assert used(st, "b-dram-0") == KiB  # but its space is taken
    resp, added = st.replica_end([pb.ReplicaEndItem(key="k", replica_id=res.replica_id,
                                                    checksum=SUM)])
    assert list(resp.codes) == [pb.ERROR_NONE] and added == [("k", "b-dram-0")]
    assert segments_of(st, "k") == ["a-dram-0", "b-dram-0"]
    got = events.get(0) or []
    assert [(e.kind, e.key, e.segment) for e in got] == [(EV.STORED, "k", "b-dram-0")]
    cmds = drain(st, "b")
    assert [(c.kind, c.key, c.offset, c.checksum) for c in cmds] == [
        (CMD.COMMITTED, "k", res.replica.offset, SUM)]


def test_added_replica_never_evicts(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    for i in range(60):  # b at its high watermark (0.95 of 64 KiB)
        put_on(st, f"fill{i}", "b-dram-0")
    before = st.stats().objects
    res = st.replica_start(["k"], "b-dram-0")[0]
    assert res.code == pb.ERROR_NO_SPACE and not res.replica_id and "never evicts" in res.error
    assert st.stats().objects == before and st.stats().evictions == 0


def test_one_replica_per_host_is_enough(clock: Clock) -> None:
    st = two_hosts(clock)
    register(st, "a2", "hA")  # another node on host A
    put_on(st, "k", "a-dram-0")
    assert st.replica_start(["k"], "a2-dram-0")[0].code == pb.ERROR_EXISTS
    first = st.replica_start(["k"], "b-dram-0")[0]
    assert first.code == pb.ERROR_NONE
    again = st.replica_start(["k"], "b-dram-0")[0]  # one is being added there
    assert again.code == pb.ERROR_EXISTS and used(st, "b-dram-0") == KiB


def test_wrong_bytes_or_a_replaced_object_are_not_added(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    assert add(st, "k", "b-dram-0", checksum=SUM + 1)[0] == pb.ERROR_INVALID
    assert used(st, "b-dram-0") == 0 and segments_of(st, "k") == ["a-dram-0"]
    res = st.replica_start(["k"], "b-dram-0")[0]
    st.remove(["k"])
    put_on(st, "k", "a-dram-0")  # the same key, another object
    resp, added = st.replica_end([pb.ReplicaEndItem(key="k", replica_id=res.replica_id,
                                                    checksum=SUM)])
    assert list(resp.codes) == [pb.ERROR_NOT_FOUND] and added == []
    assert used(st, "b-dram-0") == 0
    resp, _ = st.replica_end([pb.ReplicaEndItem(key="k", replica_id=res.replica_id)])
    assert list(resp.codes) == [pb.ERROR_NOT_FOUND]  # ended already


def test_revoke_and_timeout_free_the_space(clock: Clock) -> None:
    st = two_hosts(clock, put_timeout_s=5)
    put_on(st, "k", "a-dram-0")
    put_on(st, "j", "a-dram-0")
    res = st.replica_start(["k", "j"], "b-dram-0")
    assert used(st, "b-dram-0") == 2 * KiB
    resp, _ = st.replica_end([pb.ReplicaEndItem(key="k", replica_id=res[0].replica_id,
                                                revoke=True)])
    assert list(resp.codes) == [pb.ERROR_NONE] and used(st, "b-dram-0") == KiB
    clock.advance(6)
    st.tick()
    assert used(st, "b-dram-0") == 0 and st.adds.adding == 0
    assert segments_of(st, "k") == ["a-dram-0"]


def test_bad_requests_are_refused_clearly(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    with pytest.raises(InvalidArgument, match="not registered"):
        st.replica_start(["k"], "no-such-dram-0")
    with pytest.raises(InvalidArgument, match="empty"):
        st.replica_start(["k"], "")
    res = st.replica_start(["missing", ""], "b-dram-0")
    assert [r.code for r in res] == [pb.ERROR_NOT_FOUND, pb.ERROR_INVALID]
    ok = st.replica_start(["k"], "b-dram-0")[0]
    resp, _ = st.replica_end([pb.ReplicaEndItem(key="other", replica_id=ok.replica_id)])
    assert list(resp.codes) == [pb.ERROR_INVALID]


def test_one_replica_leaves_with_an_event_for_its_segment_only(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "m", "a-dram-0")
    assert add(st, "m", "b-dram-0")[0] == pb.ERROR_NONE
    events = st.subscribe()
    st.remove(["m"])  # a removal: one event per replica
    got = [(e.kind, e.segment) for e in events.get(0) or []]
    assert sorted(got) == [(EV.REMOVED, "a-dram-0"), (EV.REMOVED, "b-dram-0")]
    put_on(st, "k", "a-dram-0")
    assert add(st, "k", "b-dram-0")[0] == pb.ERROR_NONE
    events.get(0)
    for i in range(62):  # fill b: its LRU object (k's added replica) is evicted
        put_on(st, f"fill{i}", "b-dram-0")
    evicted = [(e.key, e.segment) for e in events.get(0) or [] if e.kind == EV.EVICTED]
    assert evicted[0] == ("k", "b-dram-0") and ("k", "a-dram-0") not in evicted
    assert segments_of(st, "k") == ["a-dram-0"]


def test_a_restarted_master_rebuilds_an_added_replica_from_the_inventory(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    assert add(st, "k", "b-dram-0")[0] == pb.ERROR_NONE
    inv = {n: [pb.InventoryItem(key=c.key, segment=c.segment, offset=c.offset, size=c.size,
                                checksum=c.checksum)
               for c in drain(st, n) if c.kind == CMD.COMMITTED] for n in ("a", "b")}
    fresh: MasterState = make(clock)
    assert register(fresh, "a", "hA", inventory=inv["a"]) == 1
    assert register(fresh, "b", "hB", inventory=inv["b"]) == 1
    assert segments_of(fresh, "k") == ["a-dram-0", "b-dram-0"]
    assert fresh.replica_records(["k"])[1][2].segment == "b-dram-0"  # what HA journals


def test_a_node_restart_cancels_replicas_being_added_there(clock: Clock) -> None:
    st = two_hosts(clock)
    put_on(st, "k", "a-dram-0")
    res = st.replica_start(["k"], "b-dram-0")[0]
    register(st, "b", "hB", incarnation="2")  # b's process restarted: the bytes are gone
    assert used(st, "b-dram-0") == 0 and st.adds.adding == 0
    resp, _ = st.replica_end([pb.ReplicaEndItem(key="k", replica_id=res.replica_id,
                                                checksum=SUM)])
    assert list(resp.codes) == [pb.ERROR_NOT_FOUND]
    assert segments_of(st, "k") == ["a-dram-0"]
