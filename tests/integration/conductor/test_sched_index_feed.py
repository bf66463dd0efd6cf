"""The Conductor's KV index follows a real store: puts, removes and a master restart."""

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

    async def main() -> None:
        index = KVIndex()
        feeder: IndexFeeder
        with cluster.client() as store, cluster.client() as writer:
            feeder = IndexFeeder(index, store, asyncio.get_running_loop(), retry_s=0.2)
            feeder.start()
            await asyncio.sleep(0.3)  # the subscription is in place
            for k in keys:
                await asyncio.to_thread(writer.put, k, b"x" * 4096)
            await _until(lambda: index.match(keys, []).global_blocks == 8)
            assert index.holders(keys[0]) == ["n0-dram-0"]
            # A removed block makes its prefix end there: no routing to a cold cache.
            await asyncio.to_thread(writer.remove, [keys[3]])
            await _until(lambda: index.match(keys, []).global_blocks == 3)
            # The master restarts: the stream breaks, the index is cleared (the events missed
            # meanwhile are unknown) and the feeder resubscribes.
            assert cluster.master is not None
            cluster.kill(cluster.master)
            await _until(lambda: index.clears >= 1 and len(index) == 0)
            cluster.start_master()
            await _until(lambda: feeder.reconnects >= 1)
            feeder.stop()
        await asyncio.to_thread(feeder._thread.join, 10)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
