"""`Watch` with a snapshot against a real master and node: what is stored, then live events,
with no gap and no repeat, while another client keeps putting and removing meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.testing import StoreCluster

pytestmark = pytest.mark.timeout(120)

_EV = pb.BlockEvent


@pytest.fixture()
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("n0", "16MiB")
        yield c


def _churn(cluster: StoreCluster, stop: threading.Event, written: list[str],
           started: threading.Event) -> None:
    """Batches of 10 puts, 3 of each batch removed again, until told to stop."""
    with cluster.client() as w:
        n = 0
        while not stop.is_set():
            keys = [f"churn-{n:05d}-{i}" for i in range(10)]
            n += 1
            assert all(e is None for e in w.batch_put(keys, [b"y" * 512] * 10))
            w.remove(keys[:3])
            written.extend(keys)
            if n == 3:
                started.set()


def test_snapshot_then_live_events_under_concurrent_puts(cluster: StoreCluster) -> None:
    before = [f"old-{i:04d}" for i in range(400)]
    with cluster.client() as c:
        for i in range(0, len(before), 50):
            assert all(e is None for e in c.batch_put(before[i:i + 50], [b"x" * 1024] * 50))
        c.remove(before[:10])
        stop, started = threading.Event(), threading.Event()
        written: list[str] = []
        writer = threading.Thread(target=_churn, args=(cluster, stop, written, started),
                                  daemon=True)
        writer.start()
        assert started.wait(30)
        stream = c.watch(snapshot=True)
        held: set[str] = set()
        snapshot_keys: list[str] = []
        end_seq = -1
        for ev in stream:  # the snapshot: STORED events without a sequence number, then END
            if ev.kind == _EV.SNAPSHOT_END:
                end_seq = ev.seq
                break
            assert ev.kind == _EV.STORED and ev.seq == 0
            assert ev.node_id == "n0" and ev.segment and ev.size > 0
            snapshot_keys.append(ev.key)
            held.add(ev.key)
        assert end_seq > 0
        assert len(snapshot_keys) == len(held), "a replica listed twice"
        assert set(before[10:]) <= held and not held & set(before[:10])
        stop.set()
        writer.join(30)
        c.put("marker", b"m")
        seqs = []
        for ev in stream:  # live: every event after the snapshot's, in order, none twice
            seqs.append(ev.seq)
            if ev.kind in (_EV.STORED, _EV.PROMOTED):
                held.add(ev.key)
            elif ev.kind in (_EV.EVICTED, _EV.REMOVED):
                held.discard(ev.key)
            if ev.key == "marker":
                break
        stream.close()  # type: ignore[attr-defined]
        assert seqs == list(range(end_seq + 1, end_seq + 1 + len(seqs)))
        assert len(seqs) > 1, "the writer's later puts came as live events"
        # What the snapshot plus the live events say is what the store holds.
        every = sorted(set(before) | set(written) | {"marker"})
        truth = {k for k, ok in zip(every, c.exists(every), strict=True) if ok}
        assert held == truth


def test_node_filter_applies_to_the_snapshot(cluster: StoreCluster) -> None:
    with cluster.client() as c:
        c.put("only", b"z" * 100)
        kinds = []
        stream = c.watch(node_id="nobody", snapshot=True)
        for ev in stream:
            kinds.append(ev.kind)
            break
        stream.close()  # type: ignore[attr-defined]
        assert kinds == [_EV.SNAPSHOT_END]
