"""The Conductor's KV index follows a real store: its snapshot at start, puts, removes, and a
master restart (the reconnection's snapshot replaces the index)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.serving.indexfeed import IndexFeeder
from mooncake_k8s.store.testing import StoreCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("n0", "16MiB")
        yield c


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def test_index_follows_store_events(cluster: StoreCluster) -> None:
    keys = [f"blk-{i:04d}" for i in range(8)]
    old = [f"old-{i:04d}" for i in range(5)]

    async def main() -> None:
        index = KVIndex()
        feeder: IndexFeeder
        with cluster.client() as store, cluster.client() as writer:
            for k in old:  # stored before the feeder starts: its snapshot brings them
                await asyncio.to_thread(writer.put, k, b"o" * 4096)
            feeder = IndexFeeder(index, store, asyncio.get_running_loop(), retry_s=0.2)
            assert not feeder.warm
            feeder.start()
            await _until(lambda: feeder.warm)
            assert index.match(old, []).global_blocks == 5
            for k in keys:
                await asyncio.to_thread(writer.put, k, b"x" * 4096)
            await _until(lambda: index.match(keys, []).global_blocks == 8)
            assert index.holders(keys[0]) == ["n0-dram-0"]
            # A removed block makes its prefix end there: no routing to a cold cache.
            await asyncio.to_thread(writer.remove, [keys[3]])
            await _until(lambda: index.match(keys, []).global_blocks == 3)
            # The master restarts: the stream breaks, the index is kept meanwhile, and the
            # new connection's snapshot replaces it (the node re-registers its objects).
            assert cluster.master is not None
            cluster.kill(cluster.master)
            await _until(lambda: not feeder.connected)
            assert index.match(keys, []).global_blocks == 3
            # Something the index must forget: a key it knows that the new master never
            # hears of (events do not carry it; only a replacing snapshot drops it).
            index.apply(1, "phantom", "n0-dram-0", "n0")
            clears = index.clears
            cluster.start_master()
            await _until(lambda: feeder.snapshots >= 2 and feeder.connected)
            assert feeder.reconnects >= 1 and index.clears == clears + 1
            await _until(lambda: index.match(old, []).global_blocks == 5)
            await _until(lambda: index.match(keys, []).global_blocks == 3)
            assert index.holders("phantom") == []
            feeder.stop()
        await asyncio.to_thread(feeder._thread.join, 10)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def test_readiness_waits_for_the_snapshot_and_is_bounded(cluster: StoreCluster) -> None:
    """/readyz's index condition: not ready until the store's snapshot is applied; with the
    store unreachable, ready (cache-blind) once `index_warmup_timeout_s` has passed."""
    from mooncake_k8s.common.netutil import free_port
    from mooncake_k8s.conductor.service import Conductor, ConductorConfig
    from mooncake_k8s.engine import EngineConfig

    async def check(master: str, reachable: bool) -> None:
        c = Conductor(ConductorConfig(prefill="127.0.0.1:1", decode="127.0.0.1:1",
                                      engine=EngineConfig(), master=master,
                                      token=cluster.token, index_warmup_timeout_s=30))
        assert c.store is not None
        feeder = c._feeder = IndexFeeder(c.index, c.store, asyncio.get_running_loop(),
                                         retry_s=0.2)
        assert c._index_not_ready() == "loading the KV index from the store's snapshot"
        feeder.start()
        try:
            if reachable:
                await _until(lambda: feeder.warm)
                assert c._index_not_ready() is None
            else:
                await _until(lambda: feeder.reconnects >= 2)
                assert not feeder.warm and c._index_not_ready() is not None
                feeder.started -= 31  # the wait is over: ready, cache-blind, and it stays so
                assert c._index_not_ready() is None and c._index_not_ready() is None
        finally:
            feeder.stop()
            await c.prefills.close()
            await c.decodes.close()
            c.store.close()

    async def main() -> None:
        await check(cluster.master_address, True)
        await check(f"127.0.0.1:{free_port()}", False)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
