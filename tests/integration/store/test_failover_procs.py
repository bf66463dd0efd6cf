"""Bounded failover: a storage node paused (SIGSTOP) while holding one of two replicas costs a
reader about one attempt timeout, not the whole call timeout, and the get still succeeds."""

from __future__ import annotations

import time

import numpy as np

from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import StoreCluster

MiB = 1 << 20
CALL_TIMEOUT_S = 10.0


def test_paused_replica_is_skipped_after_one_attempt() -> None:
    data = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8).tobytes()
    keys = [f"fo-{i}" for i in range(8)]
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "32MiB")
        cluster.start_node("b", "32MiB")
        # TCP: over shm a paused process's memory stays readable, and nothing is tested.
        with cluster.client(transport="tcp", timeout_s=CALL_TIMEOUT_S) as c:
            for k in keys:
                c.put(k, data, replicas=2)
            assert bytes(c.get(keys[0])) == data  # pooled connection to the first replica
            info = c._lookup([keys[0]])[0]
            assert info is not None and len(info.replicas) == 2
            first = info.replicas[0].peer.node_id
            paused = cluster.nodes[first]
            cluster.pause(paused)
            try:
                t0 = time.monotonic()
                assert bytes(c.get(keys[0])) == data  # from the other replica
                t1 = time.monotonic()
                assert bytes(c.get(keys[1])) == data  # the paused node is now read last
                t2 = time.monotonic()
                bufs = [bytearray(MiB) for _ in keys[2:]]
                assert c.batch_get_into(keys[2:], bufs) == [MiB] * len(bufs)
                assert all(bytes(b) == data for b in bufs)
                t3 = time.monotonic()
                with StoreClient(cluster.master_address, cluster.token, transport="tcp",
                                 timeout_s=CALL_TIMEOUT_S, attempt_timeout_s=0.3) as fresh:
                    t4 = time.monotonic()
                    assert bytes(fresh.get(keys[0])) == data  # no memory, cold connections
                    t5 = time.monotonic()
            finally:
                cluster.resume(paused)
    first_get, next_get, batch, fresh_get = t1 - t0, t2 - t1, t3 - t2, t5 - t4
    print(f"\npaused replica on {first}: first get {first_get:.2f}s (attempt timeout 1.0s), "
          f"next get {next_get * 1000:.1f}ms, batch of {len(bufs)} {batch * 1000:.1f}ms, "
          f"new client with attempt timeout 0.3s {fresh_get:.2f}s; call timeout "
          f"{CALL_TIMEOUT_S:.0f}s")
    # Only hang detection: every figure above must stay far from the whole-call timeout.
    assert max(first_get, next_get, batch, fresh_get) < CALL_TIMEOUT_S
