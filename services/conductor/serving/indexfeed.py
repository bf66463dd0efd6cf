"""Keeping the Conductor's KV index in step with the store (the I/O half of `sched.kvindex`,
which stays pure so the simulator and the benchmark drive it directly).

Every connection to the master starts with a snapshot (`WatchRequest.snapshot`): one STORED
event per replica stored now, then SNAPSHOT_END, then live events, taken under the master's one
lock so nothing falls between the two. The snapshot REPLACES the index, so a Conductor that
(re)starts or reconnects after a master restart routes cache-aware from its first request
instead of being blind to everything stored before it subscribed.

While the stream is broken the index is kept as it was (stale, not empty): a block it still
names that has gone costs a cache miss, never correctness (prefill asks the store itself and
computes what is missing), and the next connection's snapshot replaces it whole.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from mooncake_k8s.common.rpc import store_pb2
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.store.client import StoreClient

log = logging.getLogger(__name__)

_SNAPSHOT_END = store_pb2.BlockEvent.SNAPSHOT_END
_CHUNK = 8192
"""Snapshot events applied per event-loop callback: a large snapshot is applied in steps of
a few milliseconds so requests keep flowing meanwhile (between the clear and the last step
the index holds a subset of the store: cache misses at worst)."""


class IndexFeeder:
    """Keeps a `KVIndex` in step with the store: a thread reads the `Watch` stream (with its
    snapshot) and posts the events to the event loop (one thread owns the index, so the hot
    path takes no lock); on any break it resubscribes after `retry_s`, and the new snapshot
    replaces the index."""

    def __init__(self, index: KVIndex, store: StoreClient, loop: asyncio.AbstractEventLoop,
                 *, retry_s: float = 1.0,
                 on_event: Callable[[], None] | None = None) -> None:
        self.index = index
        self.store = store
        self.loop = loop
        self.retry_s = retry_s
        self.on_event = on_event
        self.connected = False
        self.reconnects = 0
        self.snapshots = 0
        """Snapshots applied to the index (set on the event loop)."""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index-feed", daemon=True)

    @property
    def warm(self) -> bool:
        """The index holds the store's contents: a first snapshot has been applied."""
        return self.snapshots > 0

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _post(self, events: list[store_pb2.BlockEvent]) -> None:
        def apply() -> None:
            for ev in events:
                self.index.apply_event(ev)
            if self.on_event is not None:
                self.on_event()

        if events and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(apply)

    def _replace(self, held: list[store_pb2.BlockEvent]) -> None:
        """Post the snapshot: clear, then apply it in chunks; the last step counts it. The
        live events read after SNAPSHOT_END are posted after these, so they apply on top."""
        index = self.index

        def step(part: list[store_pb2.BlockEvent], first: bool, last: bool) -> None:
            if first:
                index.clear()
            for ev in part:
                index.apply_event(ev)
            if last:
                self.snapshots += 1
                log.info("KV index loaded from the store's snapshot",
                         extra={"replicas": len(held), "snapshots": self.snapshots})
                if self.on_event is not None:
                    self.on_event()

        if self.loop.is_closed():
            return
        starts = range(0, max(len(held), 1), _CHUNK)
        for n, i in enumerate(starts):
            self.loop.call_soon_threadsafe(step, held[i:i + _CHUNK], n == 0,
                                           n == len(starts) - 1)

    def _follow(self) -> None:
        """One connection: gather the snapshot, replace the index, then pass live events."""
        held: list[store_pb2.BlockEvent] = []
        live = False
        for ev in self.store.watch(snapshot=True):
            if self._stop.is_set():
                return
            if live:
                self._post([ev])
            elif ev.kind == _SNAPSHOT_END:
                self._replace(held)
                held, live = [], True
                self.connected = True
                log.info("KV index following the store's block events")
            else:
                held.append(ev)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as e:
                if self._stop.is_set():
                    return
                (log.warning if self.connected or not self.reconnects else log.debug)(
                    "block event stream broke; the next connection's snapshot replaces the "
                    "KV index", extra={"error": f"{type(e).__name__}: {e}"})
            if self._stop.is_set():
                return
            self.connected = False
            self.reconnects += 1
            self._stop.wait(self.retry_s)
