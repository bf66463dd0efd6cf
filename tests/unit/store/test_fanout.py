"""Hot-object fan-out on MasterState with a fake clock: the policy's plain functions, then reads
by host adding a replica near the readers (a COPY to the reader's node naming the source on
another node), the cap, the off switch, readers spread over replicas, failed copies freeing
their space, and cool extra replicas evicted before anything else."""

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
from mooncake_k8s.store.master.fanout import (
    FanoutSettings,
    is_cool,
    spread,
    wants_replica,
)
from mooncake_k8s.store.master.state import MasterState

EV = pb.BlockEvent
CMD = pb.NodeCommand
SUM = 0xABC


@pytest.fixture
def clock() -> Clock:
    return Clock()


# -- the policy's plain functions ------------------------------------------------------------


def test_wants_replica_at_the_threshold_below_the_cap_and_not_on_a_host_with_one() -> None:
    assert not wants_replica(3, 4, 1, 4, False)
    assert wants_replica(4, 4, 1, 4, False)
    assert not wants_replica(5, 4, 1, 4, False)
    assert wants_replica(8, 4, 1, 4, False)  # retried every threshold reads (no room before)
    assert not wants_replica(4, 4, 4, 4, False)  # at the cap
    assert not wants_replica(4, 4, 1, 4, True)  # the host has one


def test_spread_rotates_and_is_cool_after_a_window() -> None:
    assert spread([1, 2, 3], 0) == [1, 2, 3]  # type: ignore[list-item]
    assert spread([1, 2, 3], 1) == [2, 3, 1]  # type: ignore[list-item]
    assert spread([1, 2, 3], 5) == [3, 1, 2]  # type: ignore[list-item]
    assert spread([], 3) == []
    assert not is_cool(100.0, 109.9, 10.0)
    assert is_cool(100.0, 110.0, 10.0)


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="threshold"):
        FanoutSettings(True, threshold=0).check()
    with pytest.raises(InvalidArgument, match="max replicas"):
        FanoutSettings(True, max_replicas=1).check()


# -- on the master's state ---------------------------------------------------------------------


def hosts(clock: Clock, on: bool = True, threshold: int = 2, max_replicas: int = 4,
          dram: int = 64 * KiB) -> MasterState:
    st: MasterState = make(clock, fanout=FanoutSettings(on, threshold, 10.0, max_replicas))
    for i, h in enumerate("abc"):
        st.register_node(h, f"127.0.0.1:{7100 + i}", f"h{h.upper()}",
                         [seg(f"{h}-dram-0", dram)], [], "1")
        drain(st, h)
    return st


def put_on(st: MasterState, key: str, segment: str, size: int = KiB) -> None:
    r = st.put_start(key, size, 1, pb.LOCAL_FIRST, "", "", [segment])
    st.put_end(key, r.put_id, SUM)


def read(st: MasterState, key: str, host: str) -> list[str]:
    """One lookup from `host` (lease released): the replicas' segments in answer order."""
    lk = st.get_replicas([key], 0, host)
    st.release_lease(lk.lease_id)
    return [r.segment for r in lk.response().objects[0].replicas]


def copies(st: MasterState, node_id: str) -> list[pb.NodeCommand]:
    return [c for c in drain(st, node_id) if c.kind == CMD.COPY]


def fan_out(st: MasterState, key: str, node_id: str, reads: int = 2) -> pb.NodeCommand:
    """Read `key` from `node_id`'s host until a COPY reaches that node, and complete it."""
    host = f"h{node_id.upper()}"
    for _ in range(reads):
        read(st, key, host)
    [cmd] = copies(st, node_id)
    assert st.command_done(node_id, cmd.id, True)
    return cmd


def test_reads_from_another_host_add_a_replica_there_copied_node_to_node(clock: Clock) -> None:
    st = hosts(clock)
    put_on(st, "k", "a-dram-0")
    drain(st, "a")
    events = st.subscribe()
    read(st, "k", "hB")
    assert copies(st, "b") == []  # one read is below the threshold
    read(st, "k", "hB")
    [cmd] = copies(st, "b")  # the reader's node copies, not the source's
    assert copies(st, "a") == []
    assert (cmd.segment, cmd.size, cmd.checksum) == ("b-dram-0", KiB, SUM)
    assert (cmd.src_replica.segment, cmd.src_replica.node_id, cmd.src_replica.host_id) == (
        "a-dram-0", "a", "hA")
    assert read(st, "k", "hB") == ["a-dram-0"]  # invisible until the copy is done
    assert used(st, "b-dram-0") == KiB
    assert st.command_done("b", cmd.id, True)
    assert read(st, "k", "hB")[0] == "b-dram-0"  # the reader's own host first now
    cmds = drain(st, "b")
    assert [(c.kind, c.key, c.segment) for c in cmds] == [(CMD.COMMITTED, "k", "b-dram-0")]
    got = events.get(0) or []
    assert [(e.kind, e.key, e.segment) for e in got] == [(EV.STORED, "k", "b-dram-0")]
    c = st.counters()
    assert (c["fanout_added"], c["fanout_hot"], c["fanout_extra"]) == (1, 1, 1)


def test_a_failed_copy_frees_its_space_and_adds_nothing(clock: Clock) -> None:
    st = hosts(clock)
    put_on(st, "k", "a-dram-0")
    read(st, "k", "hB")
    read(st, "k", "hB")
    [cmd] = copies(st, "b")
    assert st.command_done("b", cmd.id, False, "checksum mismatch after copy")
    assert used(st, "b-dram-0") == 0
    assert read(st, "k", "hB") == ["a-dram-0"]
    assert st.counters()["fanout_added"] == 0


def test_reads_on_the_replicas_host_or_with_the_switch_off_add_nothing(clock: Clock) -> None:
    st = hosts(clock)
    put_on(st, "k", "a-dram-0")
    for _ in range(6):
        read(st, "k", "hA")
    assert copies(st, "a") == []
    off = hosts(clock, on=False)
    put_on(off, "k", "a-dram-0")
    for _ in range(6):
        read(off, "k", "hB")
    assert copies(off, "b") == [] and off.counters()["fanout_added"] == 0


def test_the_cap_bounds_the_replicas_of_one_object(clock: Clock) -> None:
    st = hosts(clock, max_replicas=2)
    put_on(st, "k", "a-dram-0")
    fan_out(st, "k", "b")
    for _ in range(6):
        read(st, "k", "hC")
    assert copies(st, "c") == []
    assert sorted(read(st, "k", "hC")) == ["a-dram-0", "b-dram-0"]


def test_no_room_under_the_watermark_means_no_replica_and_no_eviction(clock: Clock) -> None:
    st = hosts(clock, dram=8 * KiB)
    put_on(st, "k", "a-dram-0")
    for i in range(7):  # b's segment at its high watermark with its own objects
        put_on(st, f"b{i}", "b-dram-0")
    before = used(st, "b-dram-0")
    for _ in range(4):
        read(st, "k", "hB")
    assert copies(st, "b") == []
    assert used(st, "b-dram-0") == before and st.evictions == 0


def test_readers_without_a_replica_take_turns_over_the_replicas(clock: Clock) -> None:
    st = hosts(clock, max_replicas=2)
    put_on(st, "k", "a-dram-0")
    fan_out(st, "k", "b")
    firsts = {read(st, "k", "hC")[0] for _ in range(4)}
    assert firsts == {"a-dram-0", "b-dram-0"}
    assert {read(st, "k", "hA")[0] for _ in range(3)} == {"a-dram-0"}  # own host first


def test_a_cool_extra_replica_is_evicted_before_older_objects(clock: Clock) -> None:
    st = hosts(clock, dram=8 * KiB)
    for i in range(5):  # b's own objects, older than the fan-out replica
        put_on(st, f"b{i}", "b-dram-0")
    put_on(st, "k", "a-dram-0")
    fan_out(st, "k", "b")
    clock.advance(11.0)  # no reads of k from hB for a window: cool
    put_on(st, "n0", "b-dram-0")
    put_on(st, "n1", "b-dram-0")  # over the watermark: something on b must go
    assert read(st, "k", "hC") == ["a-dram-0"]  # the extra replica went first
    assert all(read(st, f"b{i}", "hB") for i in range(5))  # the older objects stayed
    c = st.counters()
    assert (c["fanout_dropped"], c["fanout_extra"]) == (1, 0)


def test_an_extra_replica_still_read_from_its_host_is_not_taken_first(clock: Clock) -> None:
    st = hosts(clock, dram=8 * KiB)
    for i in range(5):
        put_on(st, f"b{i}", "b-dram-0")
    put_on(st, "k", "a-dram-0")
    fan_out(st, "k", "b")
    clock.advance(9.0)
    read(st, "k", "hB")  # read from its host: warm for another window
    clock.advance(3.0)
    put_on(st, "n0", "b-dram-0")
    put_on(st, "n1", "b-dram-0")
    assert "b-dram-0" in read(st, "k", "hC")
    assert st.counters()["fanout_dropped"] == 0
