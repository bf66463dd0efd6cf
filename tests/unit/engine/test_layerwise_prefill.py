"""Layer-wise prefill export (issue 20 item 3) with the real model: the engine hands each
layer's slice of each new block to its sink as the forward pass makes it final, and the blocks
(and first token) are the ones the store-after-prefill path produces. Through the embedded
kind against a real store: streamed and plain prefill store identical blocks, the new blocks on
the home and write segments, the tail on the write segment only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from mooncake_k8s.common.blocks import HEADER_SIZE
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2 as spb
from mooncake_k8s.engine.api import KVPlan, PrefillWork
from mooncake_k8s.engine.embedded import Engine, EngineConfig, load_engine
from mooncake_k8s.engine.embedded.prefill import EmbeddedPrefill
from mooncake_k8s.engine.embedded.structs import layerwise_from_env
from mooncake_k8s.engine.embedded.testing import GREEDY, prompt_tokens
from mooncake_k8s.store.testing import StoreCluster, store_cluster


class Recorder:
    """A LayerSink that records what it is handed, in order."""

    def __init__(self) -> None:
        self.first = -1
        self.views: Sequence[memoryview] = []
        self.tail = False
        self.ranges: list[tuple[int, int, int]] = []

    def open(self, first_block: int, views: Sequence[memoryview], tail: bool) -> None:
        self.first, self.views, self.tail = first_block, views, tail

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        self.ranges.append((index, start, end))


@pytest.mark.parametrize("extra", [0, 37])
def test_layer_export_equals_the_export_after_prefill(engine: Engine, extra: int) -> None:
    bt = engine.block_tokens
    ids = prompt_tokens(engine, 4 * bt + extra, variant=5)
    plain = engine.prefill(ids, [], GREEDY)
    imported = [b for _, b in plain.new_blocks[:2]]
    for blocks in ([], imported):  # cold, and from two imported blocks
        rec = Recorder()
        streamed = engine.prefill(ids, blocks, GREEDY, sink=rec)
        assert streamed.first_token == plain.first_token
        assert rec.first == len(blocks) and rec.tail == bool(extra)
        assert [(i, bytes(b)) for i, b in streamed.new_blocks] == \
            [(i, bytes(b)) for i, b in plain.new_blocks[len(blocks):]]
        assert (streamed.tail_block is None) == (plain.tail_block is None)
        if extra:
            assert bytes(streamed.tail_block or b"") == bytes(plain.tail_block or b"")
        # every byte handed over once; each object's layers in order, its header last
        layers = engine.layout.layers
        for index, view in enumerate(rec.views):
            mine = [(s, e) for i, s, e in rec.ranges if i == index]
            assert len(mine) == layers + 1 and mine[-1] == (0, HEADER_SIZE)
            assert [s for s, _ in mine[:-1]] == sorted(s for s, _ in mine[:-1])
            assert sum(e - s for s, e in mine) == len(view)
        # handed over while the pass goes on: the first new block is complete before the
        # last chunk (the last object's) starts
        order = [i for i, s, _ in rec.ranges if s != 0]
        last = len(rec.views) - 1
        assert len(order) - 1 - order[::-1].index(0) < order.index(last)


def test_chunks_of_several_blocks_export_each_block_once(engine: Engine) -> None:
    """With 128-token chunks a chunk completes two blocks' layer at once; a prompt ending
    mid-chunk leaves the tail for the last one."""
    big = load_engine(EngineConfig(threads=1, prefill_chunk_tokens=2 * engine.block_tokens),
                      progress=False)
    ids = prompt_tokens(big, 5 * big.block_tokens + 9, variant=7)
    plain = big.prefill(ids, [], GREEDY)
    rec = Recorder()
    streamed = big.prefill(ids, [], GREEDY, sink=rec)
    assert [bytes(b) for _, b in streamed.new_blocks] == [bytes(b) for _, b in plain.new_blocks]
    assert bytes(streamed.tail_block or b"") == bytes(plain.tail_block or b"")
    assert streamed.first_token == plain.first_token and len(rec.views) == 6
    for index, view in enumerate(rec.views):
        assert sum(e - s for i, s, e in rec.ranges if i == index) == len(view)
    # block 1 (second of the first chunk) is complete before the second chunk starts
    order = [i for i, s, _ in rec.ranges if s != 0]
    assert len(order) - 1 - order[::-1].index(1) < order.index(2)


def test_the_env_var_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_KV_LAYERWISE", raising=False)
    assert layerwise_from_env() and EngineConfig().layerwise_kv
    monkeypatch.setenv("MOONCAKE_KV_LAYERWISE", "0")
    assert not EngineConfig().layerwise_kv
    monkeypatch.setenv("MOONCAKE_KV_LAYERWISE", "yes")
    with pytest.raises(ValueError, match="MOONCAKE_KV_LAYERWISE must be 0 or 1"):
        EngineConfig()


@pytest.fixture(scope="module")
def store() -> Iterator[StoreCluster]:
    with store_cluster(nodes=2, dram_size="128MiB") as cluster:
        yield cluster


def test_streamed_and_plain_prefill_store_identical_blocks(
        store: StoreCluster, engine: Engine) -> None:
    with store.client() as client:
        home, write = (s.name for s in sorted(client.stats().segments, key=lambda s: s.node_id))
        prefills = {on: EmbeddedPrefill(EngineConfig(threads=1, layerwise_kv=on), client)
                    for on in (True, False)}
        assert prefills[True].layerwise and not prefills[False].layerwise
        bt = engine.block_tokens
        tokens = prompt_tokens(engine, 5 * bt + 20, variant=6)
        sampling = pb.Sampling(temperature=0, max_tokens=8)
        done, keys = {}, {}
        for on, p in prefills.items():
            keys[on] = tuple(p.info.block_keys(tokens, tenant=str(on)))
            plan = KVPlan(keys[on], write_segment=write, home_segment=home)
            done[on] = p.prefill(PrefillWork(f"lw-{on}", tokens, str(on), sampling, plan))
            assert done[on].stored_blocks == 5 and done[on].tail_key == f"tail/lw-{on}"
        assert done[True].first_token == done[False].first_token
        assert prefills[True].counters()[0].value == 6  # 5 blocks and the tail, streamed
        assert prefills[True].counters()[1].value == 0  # none fell back
        assert all(c.value == 0 for c in prefills[False].counters())
        for on in (True, False):
            got = client._call("GetReplicas", spb.GetReplicasRequest(
                keys=[*keys[on], done[on].tail_key])).objects
            where = [sorted(r.segment for r in o.replicas) for o in got]
            assert where == [sorted([home, write])] * 5 + [[write]]
        for a, b in zip([*keys[True], "tail/lw-True"], [*keys[False], "tail/lw-False"],
                        strict=True):
            assert bytes(client.get(a)) == bytes(client.get(b))
        # Again, two blocks read (kept on the home segment if they came from another host:
        # here all is one host) and the rest recomputed, finished at its first token: every
        # block is stored already (as good as ours, no error), the tail nobody reads is not.
        p = prefills[True]
        once = pb.Sampling(temperature=0, max_tokens=1)
        plan = KVPlan(keys[True], fetch_blocks=2, home_segment=home, keep_fetched=True)
        again = p.prefill(PrefillWork("lw-again", tokens, "True", once, plan))
        assert again.finished and again.first_token == done[True].first_token
        assert (again.cached_tokens, again.imported_blocks) == (2 * bt, 2)
        assert (again.stored_blocks, again.tail_key) == (0, "")
        assert client.exists(["tail/lw-again"]) == [False]
        assert [c.value for c in p.counters()] == [6, 0]
