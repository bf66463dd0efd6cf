"""Helper process for the master scale test (not a test module): many simulated storage nodes
and Watch subscribers against a real master, on grpc.aio.

Usage: python sim_nodes_proc.py MASTER TOKEN NODES WATCHERS OBJECTS

Each simulated node registers one 64 MiB DRAM segment, holds its NodeCommands stream open and
heartbeats every second, as a real node does (bytes never move: nothing here reads or writes a
segment). WATCHERS tasks each hold a Watch stream. OBJECTS small objects are put for lookups.
Prints one JSON line when everything is up (every watcher saw a probe event), then keeps
putting one object every 50 ms (events for the watchers) until stdin closes, then prints a JSON
report and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from typing import Any

import grpc

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2_grpc as pb_grpc

CHANNELS = 16


async def main() -> None:
    master, token = sys.argv[1], sys.argv[2]
    n_nodes, n_watchers, n_objects = (int(a) for a in sys.argv[3:6])
    md = call_metadata(token)
    channels = [grpc.aio.insecure_channel(master) for _ in range(CHANNELS)]
    stubs: list[Any] = [pb_grpc.MasterStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
    stop = asyncio.Event()
    counts: dict[str, int] = {"commands": 0, "heartbeat_errors": 0, "stream_errors": 0,
                              "watch_errors": 0}
    seen = [0] * n_watchers
    probe_seen = [False] * n_watchers

    async def node(i: int) -> None:
        stub = stubs[i % CHANNELS]
        node_id = f"sim-{i}"
        resp = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id=node_id, address=f"127.0.0.1:{20000 + i}", host_id="sim",
            segments=[pb.SegmentInfo(name=f"{node_id}-dram-0", tier=pb.DRAM, size=64 << 20,
                                     path=f"/dev/shm/{node_id}")],
            incarnation=uuid.uuid4().hex,
        ), metadata=md, timeout=60)

        async def consume() -> None:
            try:
                async for batch in stub.NodeCommands(
                    pb.NodeCommandsRequest(node_id=node_id, master_id=resp.master_id),
                    metadata=md,
                ):
                    counts["commands"] += len(batch.commands)
            except grpc.aio.AioRpcError as e:
                if not stop.is_set() and e.code() != grpc.StatusCode.CANCELLED:
                    counts["stream_errors"] += 1

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(random.random())  # spread the heartbeats over the second
        while not stop.is_set():
            try:
                await stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), metadata=md,
                                     timeout=10)
            except grpc.aio.AioRpcError:
                counts["heartbeat_errors"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        consumer.cancel()

    async def watcher(w: int) -> None:
        try:
            async for ev in stubs[w % CHANNELS].Watch(pb.WatchRequest(), metadata=md):
                seen[w] += 1
                if ev.key.startswith("probe-"):
                    probe_seen[w] = True
        except grpc.aio.AioRpcError as e:
            if not stop.is_set() and e.code() != grpc.StatusCode.CANCELLED:
                counts["watch_errors"] += 1

    async def put(key: str) -> None:
        stub = stubs[random.randrange(CHANNELS)]
        r = await stub.PutStart(pb.PutStartRequest(key=key, size=4096, placement=pb.MOST_FREE),
                                metadata=md, timeout=30)
        await stub.PutEnd(pb.PutEndRequest(key=key, put_id=r.put_id, checksum=1),
                          metadata=md, timeout=30)

    started = time.monotonic()
    node_tasks = [asyncio.create_task(node(i)) for i in range(n_nodes)]
    while True:  # every node registered (Stats counts them)
        st = await stubs[0].Stats(pb.StatsRequest(), metadata=md, timeout=30)
        if st.nodes >= n_nodes:
            break
        await asyncio.sleep(0.1)
    registered_s = time.monotonic() - started
    for i in range(0, n_objects, 100):  # before the watchers: objects to look up
        await asyncio.gather(*(put(f"obj-{j}") for j in range(i, min(i + 100, n_objects))))
    watch_tasks = [asyncio.create_task(watcher(w)) for w in range(n_watchers)]
    deadline = time.monotonic() + 60
    probes = 0
    while not all(probe_seen) and time.monotonic() < deadline:
        # a watcher whose stream was not open yet misses a probe: the next one reaches it
        await put(f"probe-{probes}")
        probes += 1
        for _ in range(20):
            if all(probe_seen):
                break
            await asyncio.sleep(0.05)
    print(json.dumps({"ready": all(probe_seen), "registered_s": round(registered_s, 2)}),
          flush=True)

    before = list(seen)
    live = 0

    async def put_loop() -> None:
        nonlocal live
        while not stop.is_set():
            await put(f"live-{live}")
            live += 1
            await asyncio.sleep(0.05)

    putter = asyncio.create_task(put_loop())
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set()
    await putter
    await asyncio.sleep(1.0)  # the last events reach every watcher
    got = [s - b for s, b in zip(seen, before, strict=True)]
    report = {**counts, "live_puts": live, "watch_min": min(got), "watch_max": max(got),
              "nodes": n_nodes, "watchers": n_watchers}
    for t in [*node_tasks, *watch_tasks]:
        t.cancel()
    await asyncio.gather(*node_tasks, *watch_tasks, return_exceptions=True)
    for ch in channels:
        await ch.close(None)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
