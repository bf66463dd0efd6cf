"""The global KV index under store events: prefixes per instance, evictions, spills, resets."""

from __future__ import annotations

from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.conductor.sched.kvindex import (
    DRAM,
    EVICTED,
    PROMOTED,
    REMOVED,
    SPILLED,
    SSD,
    STORED,
    KVIndex,
)


def _ev(kind: int, key: str, seg: str, node: str = "n0", tier: int = DRAM) -> pb.BlockEvent:
    return pb.BlockEvent(kind=kind, key=key, segment=seg, node_id=node, tier=tier)  # type: ignore[arg-type]


def test_prefix_per_instance_from_stored_events() -> None:
    ix = KVIndex()
    for k in ("k0", "k1", "k2"):
        ix.apply_event(_ev(STORED, k, "a-dram", "a"))
    for k in ("k0", "k1"):
        ix.apply_event(_ev(STORED, k, "b-dram", "b"))
    ix.apply_event(_ev(STORED, "k0", "pool-dram", "p"))
    masks = [ix.mask(["a-dram"]), ix.mask(["b-dram"]), ix.mask(["c-dram"]), 0]
    m = ix.match(["k0", "k1", "k2", "k3"], masks)
    assert m.global_blocks == 3
    assert m.dram_blocks == 3
    assert m.local_blocks == [3, 2, 0, 0]
    assert ix.holders("k0") == ["a-dram", "b-dram", "pool-dram"]


def test_prefix_stops_at_first_missing_block_even_if_later_ones_exist() -> None:
    ix = KVIndex()
    a = ix.segment("a")
    for k in ("k0", "k2"):
        ix.add(k, a)
    m = ix.match(["k0", "k1", "k2"], [1 << a])
    assert (m.global_blocks, m.local_blocks) == (1, [1])


def test_eviction_makes_the_cache_cold() -> None:
    ix = KVIndex()
    for k in ("k0", "k1"):
        ix.apply(STORED, k, "a")
        ix.apply(STORED, k, "b")
    ix.apply(EVICTED, "k1", "a")
    masks = [ix.mask(["a"]), ix.mask(["b"])]
    assert ix.match(["k0", "k1"], masks).local_blocks == [1, 2]
    ix.apply(REMOVED, "k0", "b")
    m = ix.match(["k0", "k1"], masks)
    assert m.local_blocks == [1, 0]
    assert m.global_blocks == 2  # k0 on a, k1 on b: the pool still has the whole prefix
    ix.apply(EVICTED, "k0", "a")
    assert ix.match(["k0", "k1"], masks).global_blocks == 0
    assert len(ix) == 1  # only k1 (on b) is left
    assert ix.blocks_in("a") == 0 and ix.blocks_in("b") == 1


def test_duplicate_and_unknown_events_are_harmless() -> None:
    ix = KVIndex()
    ix.apply(STORED, "k0", "a")
    ix.apply(STORED, "k0", "a")
    ix.apply(EVICTED, "k9", "a")
    ix.apply(EVICTED, "k0", "zzz")
    assert ix.blocks_in("a") == 1
    ix.apply(EVICTED, "k0", "a")
    ix.apply(EVICTED, "k0", "a")
    assert ix.blocks_in("a") == 0 and len(ix) == 0


def test_spill_moves_the_block_to_ssd_and_promote_brings_it_back() -> None:
    ix = KVIndex()
    ix.apply(STORED, "k0", "n0-dram", "n0", DRAM)
    ix.apply(STORED, "k0", "n1-dram", "n1", DRAM)
    ix.apply(SPILLED, "k0", "n0-ssd", "n0", SSD)
    assert ix.holders("k0") == ["n0-dram", "n1-dram", "n0-ssd"][1:]
    ix.apply(EVICTED, "k0", "n1-dram", "n1", DRAM)
    m = ix.match(["k0"], [])
    assert (m.global_blocks, m.dram_blocks) == (1, 0)  # only on SSD now
    ix.apply(PROMOTED, "k0", "n0-dram", "n0", DRAM)
    assert ix.match(["k0"], []).dram_blocks == 1


def test_drop_segment_and_clear() -> None:
    ix = KVIndex()
    for k in ("k0", "k1"):
        ix.apply(STORED, k, "a")
    ix.apply(STORED, "k0", "b")
    assert ix.drop_segment("a") == 2
    assert ix.match(["k0", "k1"], []).global_blocks == 1
    ix.clear()
    assert len(ix) == 0 and ix.match(["k0"], []).global_blocks == 0
    assert ix.clears == 1


def test_local_prefix_with_many_instances_sharing_the_first_block() -> None:
    ix = KVIndex()
    masks = []
    for i in range(64):
        bit = ix.segment(f"p{i}")
        masks.append(1 << bit)
        ix.add("sys", bit)
        for j in range(i % 4):
            ix.add(f"conv{j}", bit)
    keys = ["sys", "conv0", "conv1", "conv2", "new"]
    m = ix.match(keys, masks)
    assert m.global_blocks == 4
    assert m.local_blocks == [1 + (i % 4) for i in range(64)]
