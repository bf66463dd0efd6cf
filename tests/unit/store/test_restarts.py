"""Restarts and crashes, driven on MasterState / RecoveryGate / NodeRoster with a fake clock:
a node restarted under the same id, a crashed writer's claim, a restarted master's gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.recovery import NodeRoster, RecoveryGate
from mooncake_k8s.store.master.state import MasterState, PutNotFound, PutSuperseded

KiB = 1 << 10
EV = pb.BlockEvent
CMD = pb.NodeCommand


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **kw: object) -> MasterState:
    return MasterState(now=clock, wall=lambda: 1_700_000_000.0, **kw)  # type: ignore[arg-type]


def register(st: MasterState, node_id: str, incarnation: str, *, ssd: int = 0,
             inventory: list[pb.InventoryItem] | None = None) -> tuple[int, int]:
    segs = [pb.SegmentInfo(name=f"{node_id}-dram-0", tier=pb.DRAM, size=64 * KiB,
                           path=f"/dev/shm/{node_id}")]
    if ssd:
        segs.append(pb.SegmentInfo(name=f"{node_id}-ssd-0", tier=pb.SSD, size=ssd, path="/x"))
    reg = st.register_node(node_id, f"127.0.0.1:{7000 + len(node_id)}", "h", segs,
                           inventory or [], incarnation)
    return reg.restored, reg.dropped


def put(st: MasterState, key: str, size: int = KiB, **kw: object) -> pb.PutStartResponse:
    r = st.put_start(key, size, **kw)  # type: ignore[arg-type]
    assert not r.exists
    st.put_end(key, r.put_id, 0xABC)
    return r


def drain(st: MasterState, node_id: str) -> list[pb.NodeCommand]:
    stream = st.open_command_stream(node_id)
    assert stream is not None
    return st.next_commands(node_id, stream, 0) or []


def used(st: MasterState, name: str) -> int:
    return next(s.used for s in st.stats().segments if s.name == name)


# -- a node restarted under the same id -----------------------------------------------------


def test_restarted_node_drops_what_it_no_longer_holds(clock: Clock) -> None:
    st = make(clock)
    register(st, "a", "inc-1")
    register(st, "b", "inc-1")
    kept = put(st, "kept", placement=pb.PREFERRED, preferred_segment="a-dram-0")
    put(st, "gone", placement=pb.PREFERRED, preferred_segment="a-dram-0")
    put(st, "both", replicas=2)
    pending = st.put_start("writing", KiB, placement=pb.PREFERRED, preferred_segment="a-dram-0")
    events = st.subscribe()
    old_stream = st.open_command_stream("a")
    assert old_stream is not None
    # The new process kept one object (say, a persistent tier) and reports only that.
    inv = [pb.InventoryItem(key="kept", segment="a-dram-0", offset=kept.replicas[0].offset,
                            size=KiB, checksum=0xABC)]
    restored, dropped = register(st, "a", "inc-2", inventory=inv)
    assert (restored, dropped) == (1, 2)  # "gone" and a's replica of "both"
    assert st.exists(["kept", "gone", "both"])[0] == [True, False, True]
    both = st.get_replicas(["both"]).response().objects[0]
    assert [r.node_id for r in both.replicas] == ["b"]
    assert used(st, "a-dram-0") == KiB  # only "kept" still takes space there
    with pytest.raises(PutNotFound):
        st.put_end("writing", pending.put_id, 1)
    assert st.next_commands("a", old_stream, 0) is None  # the old process's stream ends
    assert drain(st, "a") == []  # nothing queued for the old process reaches the new one
    evicted = {(e.key, e.node_id) for e in events.get(0) or [] if e.kind == EV.EVICTED}
    assert evicted == {("gone", "a"), ("both", "a")}
    # and the key that was a phantom can be stored again right away
    put(st, "gone")


def test_same_incarnation_reregistering_keeps_everything(clock: Clock) -> None:
    st = make(clock)
    register(st, "a", "inc-1")
    put(st, "k")
    assert register(st, "a", "inc-1") == (0, 0)  # a broken session, not a restart
    assert register(st, "a", "") == (0, 0)  # an old node that sends no incarnation
    assert st.exists(["k"])[0] == [True]


def test_restart_cancels_copies_without_losing_the_source(clock: Clock) -> None:
    st = make(clock, high_watermark=0.5, low_watermark=0.3)
    register(st, "a", "inc-1", ssd=256 * KiB)
    r = [put(st, f"k{i}", 16 * KiB) for i in range(3)]  # k2 finds no room: k0, k1 spill
    copies = [c for c in drain(st, "a") if c.kind == CMD.COPY]
    assert [c.key for c in copies] == ["k0", "k1"]
    assert used(st, "a-ssd-0") == 48 * KiB  # two copy destinations and k2
    inv = [pb.InventoryItem(key=f"k{i}", segment=r[i].replicas[0].segment,
                            offset=r[i].replicas[0].offset, size=16 * KiB, checksum=0xABC)
           for i in range(3)]
    assert register(st, "a", "inc-2", ssd=256 * KiB, inventory=inv) == (3, 0)
    assert used(st, "a-ssd-0") == 16 * KiB  # the copies' destinations are freed
    assert not st.command_done("a", copies[0].id, True)  # the old copy is unknown now
    assert st.exists([f"k{i}" for i in range(3)])[1] == 3
    put(st, "k3", 16 * KiB)  # still no room in DRAM: spills are queued for the new process
    assert [c.key for c in drain(st, "a") if c.kind == CMD.COPY] == ["k0", "k1"]


# -- a crashed writer ------------------------------------------------------------------------


def test_crashed_writer_blocks_its_key_only_for_the_claim(clock: Clock) -> None:
    st = make(clock, put_timeout_s=30, put_claim_s=1.0, node_timeout_s=100)
    register(st, "a", "i")
    crashed = st.put_start("k", KiB)  # this writer never comes back
    other = st.put_start("k", KiB)
    assert other.exists and other.in_progress and other.put_id == 0
    assert st.exists(["k"])[0] == [False]  # never reported present before it is readable
    clock.advance(1.1)
    taken = st.put_start("k", KiB)
    assert not taken.exists and taken.put_id
    st.put_end("k", taken.put_id, 7)
    assert st.get_replicas(["k"]).response().objects[0].checksum == 7
    # the old put's space stays allocated until its own timeout, then it is reclaimed
    assert used(st, "a-dram-0") == 2 * KiB
    clock.advance(30)
    st.tick()
    assert used(st, "a-dram-0") == KiB
    with pytest.raises(PutNotFound):
        st.put_end("k", crashed.put_id, 1)


def test_slow_writer_after_its_claim_lapsed_is_superseded(clock: Clock) -> None:
    st = make(clock, put_claim_s=1.0)
    register(st, "a", "i")
    slow = st.put_start("k", KiB)
    clock.advance(2)
    fast = st.put_start("k", KiB)
    st.put_end("k", fast.put_id, 7)
    with pytest.raises(PutSuperseded, match="another writer"):
        st.put_end("k", slow.put_id, 7)
    assert used(st, "a-dram-0") == KiB  # the loser's space is freed at once
    ends = st.batch_put_end([pb.PutEndRequest(key="k", put_id=fast.put_id, checksum=7)])
    assert list(ends.codes) == [pb.ERROR_NOT_FOUND]


def test_old_put_may_still_win_after_its_claim_lapsed(clock: Clock) -> None:
    st = make(clock, put_claim_s=1.0)
    register(st, "a", "i")
    first = st.put_start("k", KiB)
    clock.advance(2)
    second = st.put_start("k", KiB)
    st.put_end("k", first.put_id, 1)  # the first one ends first: it publishes
    ends = st.batch_put_end([pb.PutEndRequest(key="k", put_id=second.put_id, checksum=1)])
    assert list(ends.codes) == [pb.ERROR_EXISTS]
    assert st.put_start("k", KiB).exists and used(st, "a-dram-0") == KiB


def test_claim_grows_with_object_size(clock: Clock) -> None:
    st = make(clock, put_claim_s=1.0)
    st.register_node("a", "a:1", "h", [pb.SegmentInfo(name="a0", tier=pb.DRAM, size=2 << 30)])
    st.put_start("big", 512 << 20)  # 2 s more at 256 MiB/s
    clock.advance(2.5)
    assert st.put_start("big", 512 << 20).in_progress
    clock.advance(1)
    assert not st.put_start("big", 512 << 20).exists


def test_put_ids_do_not_repeat_across_master_processes(clock: Clock) -> None:
    a = make(clock)
    b = make(clock)
    for st in (a, b):
        register(st, "n", "i")
    assert a.put_start("k", 10).put_id != b.put_start("k", 10).put_id
    with pytest.raises(InvalidArgument, match="put_claim_s"):
        make(clock, put_claim_s=0)


# -- a restarted master's gate and roster ----------------------------------------------------


def test_gate_opens_when_every_known_node_is_back(clock: Clock) -> None:
    gate = RecoveryGate(frozenset({"a", "b"}), grace_s=30, now=clock)
    assert not gate.is_open
    gate.registered("a")
    gate.registered("zzz")  # a node the roster did not know does not count
    assert not gate.is_open
    assert "1 of 2 known nodes" in gate.describe()
    gate.registered("b")
    assert gate.is_open


def test_gate_opens_after_grace_when_nodes_are_unknown_or_missing(clock: Clock) -> None:
    unknown = RecoveryGate(None, grace_s=3, now=clock)
    missing = RecoveryGate(frozenset({"a", "gone"}), grace_s=3, now=clock)
    missing.registered("a")
    clock.advance(2.9)
    assert not unknown.is_open and not missing.is_open
    assert "at most 0.1s left" in unknown.describe()
    clock.advance(0.2)
    assert unknown.is_open and missing.is_open
    assert RecoveryGate(frozenset(), grace_s=3, now=clock).is_open  # first start
    assert RecoveryGate(None, grace_s=0, now=clock).is_open  # recovery disabled
    with pytest.raises(ValueError, match="grace"):
        RecoveryGate(None, grace_s=-1)


def test_roster_round_trip_and_bad_files(tmp_path: Path) -> None:
    roster = NodeRoster(tmp_path / "state")
    assert roster.load() == frozenset()  # first start: nobody to wait for
    assert roster.save(["b", "a"])
    assert not roster.save(["a", "b"])  # unchanged: not rewritten
    assert json.loads(roster.path.read_text())["nodes"] == ["a", "b"]
    assert NodeRoster(tmp_path / "state").load() == frozenset({"a", "b"})
    roster.path.write_text("{not json")  # unknown nodes: wait for the whole grace period
    assert NodeRoster(tmp_path / "state").load() is None
    roster.path.write_text('{"nodes": [1, 2]}')
    assert NodeRoster(tmp_path / "state").load() is None
    assert [p.name for p in roster.dir.iterdir()] == ["nodes.json"]  # no temp files left
