"""Keeping the Conductor's KV index in step with the store's block events (the I/O half of
`sched.kvindex`, which stays pure so the simulator and the benchmark drive it directly)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from mooncake_k8s.common.rpc import store_pb2
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.store.client import StoreClient

log = logging.getLogger(__name__)


class IndexFeeder:
    """Keeps a `KVIndex` in step with the store: a thread reads the `Watch` stream and
    posts each event to the event loop (one thread owns the index, so the hot path takes no
    lock); on any break it clears the index and resubscribes with a backoff, because the
    events missed meanwhile cannot be replayed."""

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index-feed", daemon=True)

    def start(self) -> None:
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

    def _reset(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.index.clear)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in self.store.watch():
                    if not self.connected:
                        self.connected = True
                        log.info("KV index following the store's block events")
                    self._post([ev])
                    if self._stop.is_set():
                        return
            except Exception as e:
                if self._stop.is_set():
                    return
                log.warning("block event stream broke; clearing the KV index",
                            extra={"error": f"{type(e).__name__}: {e}"})
            self.connected = False
            self.reconnects += 1
            self._reset()
            self._stop.wait(self.retry_s)
