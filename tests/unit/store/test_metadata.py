"""MasterState driven directly, with a fake clock: every master behaviour without sockets."""

from __future__ import annotations

import random

import pytest

from mooncake_k8s.common.errors import InvalidArgument, NoSpace, ObjectTooLarge
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.state import MasterState, PutNotFound

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


def seg(name: str, size: int, tier: int = pb.DRAM) -> pb.SegmentInfo:
    return pb.SegmentInfo(name=name, tier=tier, size=size, path=f"/dev/shm/{name}")  # type: ignore[arg-type]


def node(st: MasterState, node_id: str, dram: int = 64 * KiB, ssd: int = 0, host: str = "h0",
         inventory: list[pb.InventoryItem] | None = None) -> int:
    segs = [seg(f"{node_id}-dram-0", dram)]
    if ssd:
        segs.append(seg(f"{node_id}-ssd-0", ssd, pb.SSD))
    address = f"127.0.0.1:{7000 + len(node_id)}"
    return st.register_node(node_id, address, host, segs, inventory or []).restored


def put(st: MasterState, key: str, size: int = KiB, **kw: object) -> pb.PutStartResponse:
    r = st.put_start(key, size, **kw)  # type: ignore[arg-type]
    assert not r.exists
    st.put_end(key, r.put_id, 0xABC)
    return r


def found(st: MasterState, keys: list[str]) -> list[bool]:
    lk = st.get_replicas(keys)
    if lk.lease_id:
        st.release_lease(lk.lease_id)
    return [o.found for o in lk.response().objects]


def drain(st: MasterState, node_id: str) -> list[pb.NodeCommand]:
    stream = st.open_command_stream(node_id)
    assert stream is not None
    return st.next_commands(node_id, stream, 0) or []


def used(st: MasterState, name: str) -> int:
    return next(s.used for s in st.stats().segments if s.name == name)


# -- two-phase put -------------------------------------------------------------------------


def test_pending_put_is_invisible_until_put_end(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    r = st.put_start("k", 3000)
    assert r.put_id and len(r.replicas) == 1
    rep = r.replicas[0]
    assert (rep.node_id, rep.segment, rep.tier, rep.offset) == ("a", "a-dram-0", pb.DRAM, 0)
    assert rep.segment_path == "/dev/shm/a-dram-0" and rep.segment_size == 64 * KiB
    assert st.exists(["k"]) == ([False], 0)
    assert found(st, ["k"]) == [False]
    # a second writer of the same key is told it exists (nothing to write)
    again = st.put_start("k", 3000)
    assert again.exists and again.put_id == 0
    st.put_end("k", r.put_id, 1234)
    assert st.exists(["k"]) == ([True], 1)
    obj = st.get_replicas(["k"]).response().objects[0]
    assert obj.found and obj.size == 3000 and obj.checksum == 1234
    assert st.put_start("k", 3000).exists
    with pytest.raises(PutNotFound):
        st.put_end("k", r.put_id, 1234)  # already ended


def test_put_end_reports_committed_to_the_node(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    r = put(st, "k", 100)
    cmds = drain(st, "a")
    assert [(c.kind, c.key, c.segment, c.offset, c.size, c.checksum) for c in cmds] == [
        (CMD.COMMITTED, "k", "a-dram-0", r.replicas[0].offset, 100, 0xABC)
    ]


def test_revoke_and_timeout_reclaim_space(clock: Clock) -> None:
    st = make(clock, put_timeout_s=5)
    node(st, "a")
    r = st.put_start("k", 10 * KiB)
    assert used(st, "a-dram-0") == 10 * KiB
    with pytest.raises(InvalidArgument, match="another key"):
        st.put_revoke("other", r.put_id)
    st.put_revoke("k", r.put_id)
    assert used(st, "a-dram-0") == 0
    with pytest.raises(PutNotFound):
        st.put_revoke("k", r.put_id)
    r2 = st.put_start("k", 10 * KiB)
    assert st.stats().pending_puts == 1
    clock.advance(4.9)
    st.tick()
    assert used(st, "a-dram-0") == 10 * KiB
    clock.advance(0.2)
    st.tick()
    assert used(st, "a-dram-0") == 0 and st.stats().pending_puts == 0
    with pytest.raises(PutNotFound, match="timed out"):
        st.put_end("k", r2.put_id, 1)
    assert not st.put_start("k", 10).exists  # the key is free again


def test_batch_forms(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    res = st.batch_put_start([
        pb.PutStartRequest(key="x", size=10),
        pb.PutStartRequest(key="", size=10),
        pb.PutStartRequest(key="y", size=1 << 40),
        pb.PutStartRequest(key="z", size=60 * KiB),
        pb.PutStartRequest(key="w", size=60 * KiB),
    ])
    assert [r.code for r in res] == [
        pb.ERROR_NONE, pb.ERROR_INVALID, pb.ERROR_TOO_LARGE, pb.ERROR_NONE, pb.ERROR_NO_SPACE]
    ends = st.batch_put_end([
        pb.PutEndRequest(key="x", put_id=res[0].ok.put_id, checksum=1),
        pb.PutEndRequest(key="q", put_id=999999),
    ])
    assert ends.errors[0] == "" and "unknown" in ends.errors[1]
    assert list(ends.codes) == [pb.ERROR_NONE, pb.ERROR_NOT_FOUND]
    assert st.exists(["x", "z"]) == ([True, False], 1)


@pytest.mark.parametrize(
    ("key", "size", "replicas", "exc", "match"),
    [
        ("", 10, 1, InvalidArgument, "empty"),
        ("a" * 513, 10, 1, InvalidArgument, "longer than 512"),
        ("é" * 300, 10, 1, InvalidArgument, "longer than 512"),  # 600 bytes in UTF-8
        ("bad\nkey", 10, 1, InvalidArgument, "control"),
        ("k", 0, 1, InvalidArgument, "size"),
        ("k", 10, 9, InvalidArgument, "replicas"),
        ("k", 2 << 20, 1, ObjectTooLarge, "too large"),  # > max_object_size
        ("k", 100 * KiB, 1, ObjectTooLarge, "too large for any segment"),
        ("k", 10, 3, NoSpace, "distinct nodes"),
    ],
)
def test_bad_puts_raise_specific_errors(
    clock: Clock, key: str, size: int, replicas: int, exc: type[Exception], match: str
) -> None:
    st = make(clock, max_object_size=1 << 20)
    node(st, "a")
    node(st, "b")
    with pytest.raises(exc, match=match):
        st.put_start(key, size, replicas)
    assert st.stats().pending_puts == 0 and all(s.used == 0 for s in st.stats().segments)


def test_no_nodes_is_no_space(clock: Clock) -> None:
    with pytest.raises(NoSpace, match="no storage segments"):
        make(clock).put_start("k", 10)


def test_ok_key_edge_cases(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    for key in ["a" * 512, "ключ/with spaces", "x"]:
        assert st.put_start(key, 1).put_id


# -- placement -----------------------------------------------------------------------------


def test_replicas_on_distinct_nodes(clock: Clock) -> None:
    st = make(clock)
    for n in "abc":
        node(st, n)
    r = st.put_start("k", KiB, replicas=3)
    assert sorted(x.node_id for x in r.replicas) == ["a", "b", "c"]
    st.put_end("k", r.put_id, 7)
    obj = st.get_replicas(["k"]).response().objects[0]
    assert len(obj.replicas) == 3
    assert all(len(drain(st, n)) == 1 for n in "abc")


def test_placement_strategies(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=64 * KiB, host="ha")
    node(st, "b", dram=128 * KiB, host="hb")
    # most free: b
    assert st.put_start("m", KiB, placement=pb.MOST_FREE).replicas[0].node_id == "b"
    # local first: the caller's host even though it has less free space
    r = st.put_start("l", KiB, placement=pb.LOCAL_FIRST, client_host_id="ha")
    assert r.replicas[0].node_id == "a"
    # unspecified = local first
    assert st.put_start("u", KiB, client_host_id="ha").replicas[0].node_id == "a"
    # unknown host: most free
    assert st.put_start("l2", KiB, client_host_id="hz").replicas[0].node_id == "b"
    # preferred segment
    r = st.put_start("p", KiB, placement=pb.PREFERRED, preferred_segment="a-dram-0")
    assert r.replicas[0].segment == "a-dram-0"
    # preferred but gone: falls back to most free
    r = st.put_start("p2", KiB, placement=pb.PREFERRED, preferred_segment="nope")
    assert r.replicas[0].node_id == "b"
    # local segment full: spills over to another node instead of evicting
    r = st.put_start("big", 57 * KiB, client_host_id="ha")  # 60 of 64 KiB: under 95%
    assert r.replicas[0].node_id == "a"
    r = st.put_start("big2", 30 * KiB, client_host_id="ha")
    assert r.replicas[0].node_id == "b"
    with pytest.raises(InvalidArgument, match="placement"):
        st.put_start("x", 1, placement=42)


def test_lookup_orders_same_host_then_dram(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", host="ha")
    node(st, "b", host="hb")
    put(st, "k", replicas=2)
    nodes_hb = [r.node_id for r in st.get_replicas(["k"], 0, "hb").response().objects[0].replicas]
    nodes_ha = [r.node_id for r in st.get_replicas(["k"], 0, "ha").response().objects[0].replicas]
    assert nodes_hb[0] == "b" and nodes_ha[0] == "a"


# -- leases, remove, exists ----------------------------------------------------------------


def test_exists_prefix_len(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    for k in ["k0", "k1", "k2", "k4"]:
        put(st, k, 64)
    assert st.exists(["k0", "k1", "k2", "k3", "k4"]) == ([True, True, True, False, True], 3)
    assert st.exists(["k0", "k1"])[1] == 2
    assert st.exists(["x", "k0"])[1] == 0
    assert st.exists([]) == ([], 0)


def test_lookup_lease_hits_misses(clock: Clock) -> None:
    st = make(clock, lease_ms=2000)
    node(st, "a")
    put(st, "k")
    lk = st.get_replicas(["k", "nope", "k"])
    resp = lk.response()
    assert [o.found for o in resp.objects] == [True, False, True]
    assert resp.lease_id and resp.lease_expires_unix_ms == 1_700_000_000_000 + 2000
    assert st.get_replicas(["nope"]).response().lease_id == 0  # nothing found, no lease
    c = st.counters()
    assert (c["hits"], c["misses"], c["leases"]) == (2, 2, 1)
    assert st.get_replicas(["k"], lease_ms=10**7).response().lease_expires_unix_ms == (
        1_700_000_000_000 + 60_000
    )  # capped


def test_remove_of_leased_object_hides_then_frees_on_release(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    put(st, "k", 4 * KiB)
    drain(st, "a")
    lease = st.get_replicas(["k"]).lease_id
    assert st.remove(["k", "unknown"]) == [True, False]
    assert st.exists(["k"])[0] == [False] and found(st, ["k"]) == [False]
    assert used(st, "a-dram-0") == 4 * KiB  # still held for the reader
    assert drain(st, "a") == []
    # the key can be written again meanwhile; it gets different space
    r = st.put_start("k", 4 * KiB)
    assert r.replicas[0].offset != 0
    st.put_revoke("k", r.put_id)
    assert st.release_lease(lease)
    assert not st.release_lease(lease)
    assert used(st, "a-dram-0") == 0
    assert [c.kind for c in drain(st, "a")] == [CMD.FREED]


def test_lease_expiry_frees_hidden_object(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    put(st, "k", 4 * KiB)
    st.get_replicas(["k"], lease_ms=500)
    st.remove(["k"])
    clock.advance(0.4)
    st.tick()
    assert used(st, "a-dram-0") == 4 * KiB
    clock.advance(0.2)
    st.tick()
    assert used(st, "a-dram-0") == 0


def test_forced_remove_frees_at_once(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    put(st, "k", 4 * KiB)
    lease = st.get_replicas(["k"]).lease_id
    assert st.remove(["k"], force=True) == [True]
    assert used(st, "a-dram-0") == 0
    assert st.release_lease(lease)  # harmless
    assert used(st, "a-dram-0") == 0


def test_leased_objects_are_never_evicted(clock: Clock) -> None:
    st = make(clock, high_watermark=1.0, low_watermark=0.9)
    node(st, "a", dram=16 * KiB)
    put(st, "old", 8 * KiB)
    put(st, "mid", 8 * KiB)
    lease = st.get_replicas(["old", "mid"]).lease_id
    with pytest.raises(NoSpace, match="leased"):
        st.put_start("new", 8 * KiB)
    st.tick()  # above the high watermark but nothing evictable
    assert st.exists(["old", "mid"])[1] == 2
    st.release_lease(lease)
    r = st.put_start("new", 8 * KiB)  # evicts the LRU one synchronously
    assert r.put_id
    assert st.exists(["old", "mid"])[0] == [False, True]
    assert st.counters()["evictions"] == 1


def test_sync_eviction_is_lru_and_soft_pin_goes_last(clock: Clock) -> None:
    st = make(clock, high_watermark=1.0, low_watermark=0.9)
    node(st, "a", dram=32 * KiB)
    for k in ["k0", "k1", "k2", "k3"]:
        put(st, k, 8 * KiB)
    assert st.pin(["k0", "missing"]) == [True, False]
    found(st, ["k1"])  # k1 becomes most recent; LRU order now k0(pinned), k2, k3, k1
    put(st, "n1", 8 * KiB)
    assert st.exists(["k0", "k1", "k2", "k3"])[0] == [True, True, False, True]
    # layout now k0 | k1 | n1 | k3: evicting k3 and k1 frees 16 KiB but not contiguously, so
    # eviction goes on in LRU order (n1) until the allocation fits
    put(st, "n2", 16 * KiB)
    assert st.exists(["k0", "k1", "k3", "n1"])[0] == [True, False, False, False]
    # a 32 KiB object needs everything: unpinned victims cannot free enough, so pins go too
    put(st, "huge", 32 * KiB)
    assert st.exists(["k0", "n2", "huge"])[0] == [False, False, True]
    st.pin(["huge"], False)


def test_soft_pin_spared_by_watermarks_when_others_suffice(clock: Clock) -> None:
    st = make(clock, high_watermark=0.5, low_watermark=0.25)
    node(st, "a", dram=64 * KiB)
    put(st, "k0", 8 * KiB)
    put(st, "k1", 8 * KiB)
    st.pin(["k0", "k1"])
    for i in range(2, 8):
        put(st, f"k{i}", 8 * KiB)
        st.tick()
        assert used(st, "a-dram-0") <= 32 * KiB
    assert st.exists(["k0", "k1"])[1] == 2
    assert st.counters()["evictions"] >= 3


# -- watermarks ----------------------------------------------------------------------------


@pytest.mark.parametrize("tick", [True, False])
def test_watermarks_hold_under_3x_fill(clock: Clock, tick: bool) -> None:
    st = make(clock, high_watermark=0.9, low_watermark=0.7)
    node(st, "a", dram=256 * KiB)
    cap = 256 * KiB
    for i in range(3 * 256 // 4):
        put(st, f"k{i}", 4 * KiB)
        if tick:
            st.tick()
        # the put path itself keeps the high watermark (no burst of eviction on the next tick)
        assert used(st, "a-dram-0") <= 0.9 * cap
    assert st.counters()["evictions"] > 0
    # the newest objects survive, the oldest went first
    present, _ = st.exists([f"k{i}" for i in range(3 * 256 // 4)])
    assert present[-1] and not present[0]
    first_kept = present.index(True)
    assert all(present[first_kept:])


# -- tiers: spill and promote --------------------------------------------------------------


def test_spill_to_ssd_then_promote_back(clock: Clock) -> None:
    st = make(clock, high_watermark=0.8, low_watermark=0.5)
    node(st, "a", dram=32 * KiB, ssd=256 * KiB)
    drain(st, "a")
    events = st.subscribe()
    for i in range(4):
        # k3 finds no room under 80%: spills are queued down to 50% (with room for k3), and
        # k3 lands on SSD meanwhile; no tier is ever above its high watermark
        put(st, f"k{i}", 8 * KiB)
        assert used(st, "a-dram-0") <= 0.8 * 32 * KiB
    k3 = st.get_replicas(["k3"]).response().objects[0]
    assert [r.tier for r in k3.replicas] == [pb.SSD]
    st.tick()
    cmds = drain(st, "a")
    copies = [c for c in cmds if c.kind == CMD.COPY]
    assert [c.key for c in copies] == ["k0", "k1"]  # down to 50%, LRU first
    c0 = copies[0]
    assert c0.src_segment == "a-dram-0" and c0.segment == "a-ssd-0" and c0.size == 8 * KiB
    assert c0.checksum == 0xABC
    # until the copy is done the DRAM replica stays readable and nothing more is evicted
    st.tick()
    assert drain(st, "a") == []
    lk = st.get_replicas(["k0"])
    assert [r.tier for r in lk.response().objects[0].replicas] == [pb.DRAM]
    st.release_lease(lk.lease_id)
    assert st.command_done("a", c0.id, True)
    assert not st.command_done("a", c0.id, True)  # unknown now
    assert st.command_done("a", copies[1].id, False, "disk error")
    after = drain(st, "a")
    assert [(c.kind, c.segment) for c in after] == [
        (CMD.COMMITTED, "a-ssd-0"),
        (CMD.FREED, "a-dram-0"),  # k0 moved
        (CMD.FREED, "a-dram-0"),  # k1 evicted after its failed spill
    ]
    assert used(st, "a-ssd-0") == 16 * KiB and used(st, "a-dram-0") == 8 * KiB  # k0+k3, k2
    obj = st.get_replicas(["k0"]).response().objects[0]
    assert [r.tier for r in obj.replicas] == [pb.SSD]
    assert st.exists(["k1"])[0] == [False]
    c = st.counters()
    assert (c["spills"], c["evictions"]) == (1, 1)
    # that SSD hit queued a promotion back to DRAM
    promote = [x for x in drain(st, "a") if x.kind == CMD.COPY]
    assert len(promote) == 1
    p = promote[0]
    assert p.src_segment == "a-ssd-0" and p.segment == "a-dram-0"
    st.get_replicas(["k0"])  # in flight: not queued twice
    assert drain(st, "a") == []
    st.command_done("a", p.id, True)
    obj = st.get_replicas(["k0"]).response().objects[0]
    assert [r.tier for r in obj.replicas] == [pb.DRAM, pb.SSD]
    assert st.counters()["promotions"] == 1
    kinds = [(e.kind, e.key, e.tier) for e in events.get(0) or []]
    assert (EV.SPILLED, "k0", pb.SSD) in kinds
    assert (EV.EVICTED, "k1", pb.DRAM) in kinds
    assert (EV.PROMOTED, "k0", pb.DRAM) in kinds


def test_spill_copy_timeout_and_removed_object(clock: Clock) -> None:
    st = make(clock, high_watermark=0.5, low_watermark=0.3, put_timeout_s=3)
    node(st, "a", dram=32 * KiB, ssd=64 * KiB)
    put(st, "k0", 8 * KiB)
    put(st, "k1", 8 * KiB)
    put(st, "k2", 8 * KiB)  # no room under 50%: k0 and k1 spill, k2 lands on SSD
    st.tick()
    copies = [c for c in drain(st, "a") if c.kind == CMD.COPY]
    assert len(copies) == 2
    assert used(st, "a-ssd-0") == 24 * KiB
    st.remove(["k0"])  # removed while its spill runs: the SSD copy is discarded on done
    st.command_done("a", copies[0].id, True)
    assert used(st, "a-ssd-0") == 16 * KiB
    clock.advance(3.1)
    st.tick()  # k1's copy never answered: SSD space back, k1 evicted from DRAM
    assert used(st, "a-ssd-0") == 8 * KiB
    assert st.exists(["k1", "k2"])[0] == [False, True]


def test_ssd_segments_evict_by_lru(clock: Clock) -> None:
    st = make(clock, high_watermark=0.8, low_watermark=0.5)
    inv = [
        pb.InventoryItem(key=f"s{i}", segment="a-ssd-0", offset=i * 8 * KiB, size=8 * KiB,
                         checksum=i)
        for i in range(4)
    ]
    node(st, "a", dram=1 * KiB, ssd=32 * KiB, inventory=inv)
    st.tick()
    assert used(st, "a-ssd-0") == 16 * KiB
    assert st.exists([f"s{i}" for i in range(4)])[0] == [False, False, True, True]


# -- nodes ---------------------------------------------------------------------------------


def test_node_death_drops_replicas_and_pending_puts(clock: Clock) -> None:
    st = make(clock, node_timeout_s=10)
    node(st, "a")
    node(st, "b")
    put(st, "both", replicas=2)
    put(st, "only-a", placement=pb.PREFERRED, preferred_segment="a-dram-0")
    pending = st.put_start("p", KiB, placement=pb.PREFERRED, preferred_segment="a-dram-0")
    events = st.subscribe()
    clock.advance(6)
    assert st.heartbeat("b")
    clock.advance(6)
    st.tick()
    assert st.stats().nodes == 1 and not st.heartbeat("a")
    assert st.exists(["both", "only-a"])[0] == [True, False]
    reps = st.get_replicas(["both"]).response().objects[0].replicas
    assert [r.node_id for r in reps] == ["b"]
    with pytest.raises(PutNotFound):
        st.put_end("p", pending.put_id, 1)
    evs = events.get(0) or []
    assert {(e.kind, e.key, e.node_id) for e in evs} == {
        (EV.EVICTED, "both", "a"), (EV.EVICTED, "only-a", "a")
    }
    assert st.open_command_stream("a") is None


def test_rebuild_from_inventory_rejects_conflicts(clock: Clock) -> None:
    st = make(clock)
    node(st, "b")
    put(st, "shared", 100)  # on b, checksum 0xABC
    inv = [
        pb.InventoryItem(key="x", segment="a-dram-0", offset=0, size=100, checksum=1),
        pb.InventoryItem(key="y", segment="a-dram-0", offset=64, size=10, checksum=2),  # overlaps
        pb.InventoryItem(key="z", segment="a-dram-0", offset=1024, size=10, checksum=3),
        pb.InventoryItem(key="shared", segment="a-dram-0", offset=2048, size=100, checksum=0xABC),
        pb.InventoryItem(key="w", segment="other-seg", offset=0, size=10, checksum=4),
        pb.InventoryItem(key="v", segment="a-dram-0", offset=4096, size=10**9, checksum=5),
    ]
    assert node(st, "a", inventory=inv) == 3
    assert st.exists(["x", "y", "z", "shared", "w", "v"])[0] == [
        True, False, True, True, False, False
    ]
    obj = st.get_replicas(["x"]).response().objects[0]
    assert (obj.size, obj.checksum, obj.replicas[0].offset) == (100, 1, 0)
    assert len(st.get_replicas(["shared"]).response().objects[0].replicas) == 2
    freed = {(c.key, c.offset) for c in drain(st, "a") if c.kind == CMD.FREED}
    assert freed == {("y", 64), ("w", 0), ("v", 4096)}
    # the restored space is really taken
    assert used(st, "a-dram-0") == 128 + 64 + 128
    # re-registering with the same segments and inventory keeps everything, rejects nothing
    assert node(st, "a", inventory=inv[:1]) == 1
    assert drain(st, "a") == []
    assert st.exists(["x", "z"])[1] == 2


def test_reregistration_with_new_segments_replaces_the_node(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=64 * KiB)
    put(st, "k")
    node(st, "a", dram=128 * KiB)
    assert st.exists(["k"])[0] == [False]
    assert next(s.size for s in st.stats().segments if s.name == "a-dram-0") == 128 * KiB
    with pytest.raises(InvalidArgument, match="already registered"):
        st.register_node("b", "x:1", "h", [seg("a-dram-0", 10)])


@pytest.mark.parametrize(
    ("node_id", "address", "segments", "match"),
    [
        ("", "a:1", [seg("s", 10)], "node_id"),
        ("n", "", [seg("s", 10)], "address"),
        ("n", "a:1", [], "at least one segment"),
        ("n", "a:1", [seg("s", 0)], "size 0"),
        ("n", "a:1", [seg("s", 10), seg("s", 10)], "twice"),
        ("n", "a:1", [pb.SegmentInfo(name="s", size=10)], "tier"),
    ],
)
def test_bad_registrations(
    clock: Clock, node_id: str, address: str, segments: list[pb.SegmentInfo], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make(clock).register_node(node_id, address, "h", segments)


def test_command_streams(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    assert st.open_command_stream("a", "another-master") is None
    assert st.open_command_stream("ghost") is None
    s1 = st.open_command_stream("a", st.master_id)
    assert s1 is not None
    assert st.next_commands("a", s1, 0) == []
    s2 = st.open_command_stream("a")
    assert st.next_commands("a", s1, 0) is None  # superseded
    put(st, "k")
    assert s2 is not None
    assert [c.kind for c in st.next_commands("a", s2, 0) or []] == [CMD.COMMITTED]
    st.close()
    assert st.next_commands("a", s2, 0) is None


# -- events, stats -------------------------------------------------------------------------


def test_events_in_seq_order_and_node_filter(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    node(st, "b")
    everything = st.subscribe()
    only_b = st.subscribe("b")
    put(st, "k1", replicas=2)
    put(st, "k2", placement=pb.PREFERRED, preferred_segment="a-dram-0")
    st.remove(["k1", "k2"])
    evs = everything.get(0) or []
    assert [e.seq for e in evs] == sorted(e.seq for e in evs)
    assert len({e.seq for e in evs}) == len(evs) == 6
    assert [(e.kind, e.key) for e in evs] == [
        (EV.STORED, "k1"), (EV.STORED, "k1"), (EV.STORED, "k2"),
        (EV.REMOVED, "k1"), (EV.REMOVED, "k1"), (EV.REMOVED, "k2"),
    ]
    assert all(e.unix_ms == 1_700_000_000_000 and e.size == KiB for e in evs)
    assert [(e.kind, e.node_id) for e in only_b.get(0) or []] == [
        (EV.STORED, "b"), (EV.REMOVED, "b")
    ]
    only_b.close()
    assert only_b.get(0) is None


def test_slow_subscriber_is_disconnected(clock: Clock) -> None:
    st = make(clock)
    node(st, "a")
    slow = st.subscribe(max_queue=5)
    fast = st.subscribe()
    for i in range(10):
        put(st, f"k{i}", 64)
    assert slow.overflowed and slow.get(0) is None
    assert len(fast.get(0) or []) == 10


def test_stats(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", ssd=128 * KiB)
    put(st, "k", 1000)
    st.put_start("p", 10)
    s = st.stats()
    assert (s.objects, s.pending_puts, s.nodes) == (1, 1, 1)
    assert s.master_id == st.master_id and s.meta_bytes_estimate > 0
    by = {x.name: x for x in s.segments}
    assert by["a-dram-0"].used == 1024 + 64 and by["a-dram-0"].objects == 1
    assert by["a-ssd-0"].tier == pb.SSD and by["a-ssd-0"].size == 128 * KiB


def test_bad_watermarks() -> None:
    with pytest.raises(InvalidArgument):
        MasterState(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(InvalidArgument):
        MasterState(high_watermark=1.5)


def test_spill_of_a_leased_object_keeps_both_replicas(clock: Clock) -> None:
    st = make(clock, high_watermark=0.7, low_watermark=0.5)
    node(st, "a", dram=32 * KiB, ssd=64 * KiB)
    put(st, "k0", 8 * KiB)
    put(st, "k1", 8 * KiB)
    put(st, "k2", 8 * KiB)  # no room under 70%: k0 spills, k2 lands on SSD
    (copy,) = [c for c in drain(st, "a") if c.kind == CMD.COPY]
    lease = st.get_replicas(["k0"]).lease_id  # a reader holds the DRAM replica meanwhile
    st.command_done("a", copy.id, True)
    reps = st.get_replicas(["k0"]).response().objects[0].replicas
    assert [r.tier for r in reps] == [pb.DRAM, pb.SSD]
    assert used(st, "a-dram-0") == 16 * KiB  # not freed under the lease
    st.release_lease(lease)
    clock.advance(3)  # the second lookup's lease expires too
    st.tick()
    put(st, "k3", 8 * KiB)  # no room again: the LRU one (k1) spills; k0 keeps its SSD copy
    assert st.exists(["k0"])[0] == [True]
    reps = st.get_replicas(["k0"]).response().objects[0].replicas
    assert pb.SSD in [r.tier for r in reps]


def test_burst_faster_than_spilling_lands_on_ssd_instead_of_dropping(clock: Clock) -> None:
    st = make(clock)
    node(st, "a", dram=32 * KiB, ssd=256 * KiB)
    for i in range(12):  # 3x DRAM, no copy ever completes
        put(st, f"k{i}", 8 * KiB)
    assert st.exists([f"k{i}" for i in range(12)])[1] == 12  # nothing dropped
    assert st.counters()["evictions"] == 0
    tiers = {
        k: [r.tier for r in o.replicas]
        for k, o in zip(["k0", "k11"], st.get_replicas(["k0", "k11"]).response().objects,
                        strict=True)
    }
    assert tiers == {"k0": [pb.DRAM], "k11": [pb.SSD]}


@pytest.mark.parametrize("seed", range(6))
def test_watermarks_hold_on_every_tier_under_bursts(clock: Clock, seed: int) -> None:
    """Random bursts of puts, lookups (promotions), copies finishing late, failing or never,
    removals and ticks: after every step no segment of any tier is above its high watermark,
    spill destinations included."""
    rng = random.Random(seed)
    st = make(clock, high_watermark=0.8, low_watermark=0.6, put_timeout_s=5)
    node(st, "a", dram=64 * KiB, ssd=96 * KiB)
    node(st, "b", dram=32 * KiB)
    caps = {s.name: s.size for s in st.stats().segments}
    keys: list[str] = []
    copies: list[pb.NodeCommand] = []

    def check() -> None:
        for s in st.stats().segments:
            assert s.used <= 0.8 * caps[s.name], (s.name, s.used, caps[s.name])

    for step in range(400):
        op = rng.random()
        if op < 0.55:
            key = f"k{step}"
            try:
                put(st, key, rng.choice([1, 2, 4, 8]) * KiB, replicas=rng.choice([1, 1, 2]))
                keys.append(key)
            except NoSpace:
                pass  # everything left is leased or in flight: refused, never overfilled
        elif op < 0.7 and keys:
            lk = st.get_replicas(rng.sample(keys, min(3, len(keys))))  # may queue promotions
            if lk.lease_id and rng.random() < 0.7:
                st.release_lease(lk.lease_id)
        elif op < 0.85:
            for n in ("a", "b"):
                copies += [c for c in drain(st, n) if c.kind == CMD.COPY]
            rng.shuffle(copies)
            for c in copies[: rng.randint(0, len(copies))]:
                st.command_done("a", c.id, rng.random() < 0.9, "disk error")
                copies.remove(c)
        elif op < 0.9 and keys:
            st.remove([rng.choice(keys)])
        else:
            clock.advance(rng.choice([0.1, 1.0, 3.0]))
            st.heartbeat("a")
            st.heartbeat("b")
            st.tick()
        check()
    counts = st.counters()
    assert counts["spills"] > 0 and counts["evictions"] > 0
