"""Block-event fan-out: every subscriber gets its own bounded queue.

Publishing never blocks the master: a subscriber whose queue is full is disconnected (marked
overflowed and closed) instead; it can resubscribe and resynchronise from a lookup. Sequence
numbers are assigned by the publisher (the master state), so they are strictly increasing in
publication order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from mooncake_k8s.common.rpc import store_pb2 as pb


class Subscription:
    """One subscriber's queue; `get` blocks until events arrive, a timeout, or close.

    A subscriber served without a blocked thread sets `waker` instead and polls `get(0)`: it
    is called (from the publishing thread) whenever events were queued or the queue closed.
    """

    def __init__(self, hub: EventHub, node_id: str, max_queue: int) -> None:
        self.waker: Callable[[], None] | None = None
        self._hub = hub
        self.node_id = node_id
        self.max_queue = max_queue
        self._queue: deque[pb.BlockEvent] = deque()
        self._cond = threading.Condition(threading.Lock())
        self.closed = False
        self.overflowed = False

    def _offer(self, events: list[pb.BlockEvent]) -> None:
        with self._cond:
            if self.closed:
                return
            if self.node_id:
                events = [e for e in events if e.node_id == self.node_id]
                if not events:
                    return
            if len(self._queue) + len(events) > self.max_queue:
                self.overflowed = True
                self.closed = True
                self._queue.clear()
            else:
                self._queue.extend(events)
            self._cond.notify_all()
        if self.waker is not None:
            self.waker()

    def get(self, timeout: float | None = None) -> list[pb.BlockEvent] | None:
        """Queued events (possibly empty on timeout), or None once closed and drained."""
        with self._cond:
            if not self._queue and not self.closed and (timeout is None or timeout > 0):
                self._cond.wait(timeout)
            if self._queue:
                out = list(self._queue)
                self._queue.clear()
                return out
            return None if self.closed else []

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._hub._discard(self)
        if self.waker is not None:
            self.waker()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class EventHub:
    def __init__(self, max_queue: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self.max_queue = max_queue
        self.dropped_subscribers = 0

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def subscribe(self, node_id: str = "", max_queue: int | None = None) -> Subscription:
        sub = Subscription(self, node_id, max_queue or self.max_queue)
        with self._lock:
            self._subs.append(sub)
        return sub

    def publish(self, events: Iterable[pb.BlockEvent]) -> None:
        batch = list(events)
        if not batch:
            return
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub._offer(batch)
            if sub.overflowed:
                with self._lock:
                    if sub in self._subs:
                        self._subs.remove(sub)
                        self.dropped_subscribers += 1

    def _discard(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            with sub._cond:
                sub.closed = True
                sub._cond.notify_all()
            if sub.waker is not None:
                sub.waker()
