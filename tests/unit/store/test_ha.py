"""Master HA pieces on their own: the commit journal restored into a new leader's state, and the
Redis coordinator (election, fencing, journal, roster, pins) against a real redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.masterlink import parse_masters
from mooncake_k8s.store.master.config import MasterConfig
from mooncake_k8s.store.master.ha import (
    Fenced,
    Holder,
    JournalEntry,
    RedisCoordinator,
    redis_location,
)
from mooncake_k8s.store.master.recovery import RecoveryGate
from mooncake_k8s.store.master.servicer import MasterServicer
from mooncake_k8s.store.master.state import MasterState
from mooncake_k8s.store.testing import RedisServer

KiB = 1 << 10
CMD = pb.NodeCommand


def seg(node: str) -> list[pb.SegmentInfo]:
    return [pb.SegmentInfo(name=f"{node}-dram-0", tier=pb.DRAM, size=64 * KiB, path="/x")]


def item(key: str, offset: int, node: str = "a") -> pb.InventoryItem:
    return pb.InventoryItem(key=key, segment=f"{node}-dram-0", offset=offset, size=KiB,
                            checksum=7)


# -- the journal in the state ---------------------------------------------------------------


def test_journal_entries_are_restored_and_sent_to_the_node() -> None:
    st = MasterState()
    reg = st.register_node("a", "a:1", "h", seg("a"), [item("held", 0)], "inc",
                           journal=[item("acked", 4 * KiB), item("stale", 0)])
    # "stale" names a location the node reports holding something else: the node wins.
    assert reg.restored == 2
    assert st.exists(["held", "acked", "stale"])[0] == [True, True, False]
    stream = st.open_command_stream("a")
    assert stream is not None
    cmds = st.next_commands("a", stream, 0) or []
    assert [(c.kind, c.key, c.offset) for c in cmds] == [(CMD.COMMITTED, "acked", 4 * KiB)]


def test_replica_records_describe_every_replica() -> None:
    st = MasterState()
    st.register_node("a", "a:1", "h", seg("a"), [], "inc-a")
    st.register_node("b", "b:1", "h", seg("b"), [], "inc-b")
    r = st.put_start("k", KiB, replicas=2)
    assert st.replica_records(["k"]) == []  # pending: not journaled
    st.put_end("k", r.put_id, 9)
    recs = st.replica_records(["k", "missing"])
    assert sorted((n, inc, it.segment, it.size, it.checksum) for n, inc, it in recs) == [
        ("a", "inc-a", "a-dram-0", KiB, 9), ("b", "inc-b", "b-dram-0", KiB, 9)]


def test_master_lists_are_parsed_with_clear_errors() -> None:
    assert parse_masters(" m0:1, m1:2 ,m0:1") == ["m0:1", "m1:2"]
    assert parse_masters("dns:master.ns.svc:50051") == ["dns:master.ns.svc:50051"]
    for bad, word in (("m0:1,,m1:2", "empty"), ("m0", "not host:port"),
                      ("m0:99999", "not host:port"), (":1", "not host:port")):
        with pytest.raises(InvalidArgument, match=word):
            parse_masters(bad)


def test_redis_location_never_shows_the_password() -> None:
    assert redis_location("redis://:s3cret@redis.ns:6380/0") == "redis.ns:6380"
    assert "s3cret" not in redis_location("redis://user:s3cret@h/1")
    assert Holder.parse(b"7|id|10.0.0.1:50051") == Holder(7, "id", "10.0.0.1:50051")
    assert Holder.parse(b"garbage") is None


# -- the coordinator on a real Redis --------------------------------------------------------


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path)
    try:
        yield server.url
    finally:
        server.stop()


def wait(pred: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise TimeoutError


def coordinator(url: str, name: str, **kw: object) -> RedisCoordinator:
    return RedisCoordinator(url, f"{name}:1", prefix="t", lease_ms=400, master_id=name,
                            **kw)  # type: ignore[arg-type]


def test_one_leader_then_a_takeover_with_a_larger_fencing_token(redis_url: str) -> None:
    promoted: list[tuple[str, int]] = []
    a = coordinator(redis_url, "a", on_promoted=lambda e: promoted.append(("a", e)))
    b = coordinator(redis_url, "b", on_promoted=lambda e: promoted.append(("b", e)))
    a.start()
    wait(lambda: a.is_leader)
    b.start()
    time.sleep(0.5)  # longer than the lease: a keeps renewing, b stays standby
    assert a.is_leader and not b.is_leader
    assert b.leader_hint() == "a:1"
    a.stop(resign=False)  # like kill -9: the lease lapses on its own
    wait(lambda: b.is_leader)
    assert promoted == [("a", 1), ("b", 2)]
    b.stop()


def test_a_deposed_leader_cannot_write(redis_url: str) -> None:
    a = coordinator(redis_url, "a")
    a.start()
    wait(lambda: a.is_leader)
    entry = JournalEntry("n", "inc", item("k", 0, "n"))
    a.journal_commits([entry])
    a._stop.set()  # the renewals stop, as in a paused process
    a._thread.join()  # type: ignore[union-attr]
    b = coordinator(redis_url, "b")
    b.start()
    wait(lambda: b.is_leader)
    assert not a.is_leader  # its own clock already says the lease is gone
    a._trusted_until = time.monotonic() + 10  # even a leader whose clock lies is fenced
    with pytest.raises(Fenced):
        a.journal_commits([JournalEntry("n", "inc", item("k2", KiB, "n"))])
    assert a.deposed.is_set()
    assert [it.key for it in b.journal_for("n", "inc")] == ["k"]
    b.stop()


def test_journal_roster_and_pins_round_trip(redis_url: str) -> None:
    a = coordinator(redis_url, "a", journal_keep_s=0.2)
    a.start()
    wait(lambda: a.is_leader)
    a.journal_commits([JournalEntry("n", "inc-1", item("old", 0, "n")),
                       JournalEntry("n", "inc-2", item("new", KiB, "n"))])
    assert [it.key for it in a.journal_for("n", "inc-2")] == ["new"]  # the other process's
    a.journal_forget([JournalEntry("n", "inc-2", item("new", KiB, "n"))])
    assert a.journal_for("n", "inc-2") == []
    a.journal_commits([JournalEntry("n", "inc-2", item("x", 0, "n"))])
    # "x" reused the location of "old": its entry replaced the stale one.
    assert [it.key for it in a.journal_for("n", "inc-2")] == ["x"]
    assert a.journal_for("n", "inc-1") == []
    time.sleep(0.3)
    assert a.trim_journal(["n"]) == 1
    assert a.journal_for("n", "inc-2") == []
    a.save_roster(["n0", "n1"], frozenset())
    a.save_roster(["n1", "n2"], frozenset({"n0", "n1"}))
    assert a.load_roster() == {"n1", "n2"}
    a.save_pins(["p", "q"], True)
    a.save_pins(["q"], False)
    assert a.load_pins() == ["p"]
    a.stop()


def test_an_added_replica_is_journaled_before_the_answer(redis_url: str) -> None:
    """ReplicaEnd through the servicer of an HA leader writes the new replica (and only it)
    to the journal, so a next leader restores it even when the node never heard of it."""
    ha = coordinator(redis_url, "a")
    ha.start()
    wait(lambda: ha.is_leader)
    try:
        st = MasterState()
        st.register_node("a", "a:1", "hA", seg("a"), [], "inc-a")
        st.register_node("b", "b:1", "hB", seg("b"), [], "inc-b")
        servicer = MasterServicer(st, MasterConfig(), threading.Event(),
                                  RecoveryGate(None, 0), ha)
        r = st.put_start("k", KiB, 1, pb.LOCAL_FIRST, "", "", ["a-dram-0"])
        st.put_end("k", r.put_id, 7)  # (the checksum `item` gives the inventory below)
        res = st.replica_start(["k"], "b-dram-0")[0]
        resp = servicer.ReplicaEnd(pb.ReplicaEndRequest(items=[pb.ReplicaEndItem(
            key="k", replica_id=res.replica_id, checksum=7)]), None)
        assert list(resp.codes) == [pb.ERROR_NONE]
        journal = ha.journal_for("b", "inc-b")
        assert [(i.key, i.offset) for i in journal] == [("k", res.replica.offset)]
        assert ha.journal_for("a", "inc-a") == []  # the put's own was never journaled here
        fresh = MasterState()  # the next leader: b re-registers with an empty inventory
        fresh.register_node("a", "a:1", "hA", seg("a"), [item("k", 0)], "inc-a")
        fresh.register_node("b", "b:1", "hB", seg("b"), [], "inc-b", journal=journal)
        got = fresh.get_replicas(["k"]).response().objects[0]
        assert sorted(x.segment for x in got.replicas) == ["a-dram-0", "b-dram-0"]
    finally:
        ha.stop()
