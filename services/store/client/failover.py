"""Which replica a client reads first when some of its peers are sick.

A read tries the nearest replica, then the others. A peer that is paused (SIGSTOP, a long GC, a
swapping host) or black-holed costs one transfer attempt, bounded by the client's
`attempt_timeout_s` (about a second), before the next replica is read. Without memory of that
failure every following read would pay the same second again; `PeerHealth` remembers peers
that just failed a transfer and puts their replicas last for a while (`penalty_s`), so one
stalled node costs each client roughly one attempt, not one per read. A success clears the mark.

Used only by `client.StoreClient`; plain data and a lock, no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class _HasAddress(Protocol):
    @property
    def address(self) -> str: ...


class _Replica(Protocol):
    @property
    def peer(self) -> _HasAddress: ...


R = TypeVar("R", bound=_Replica)


class PeerHealth:
    """Peers (by transfer address) that failed a transfer in the last `penalty_s` seconds."""

    def __init__(self, penalty_s: float = 5.0, now: Callable[[], float] = time.monotonic) -> None:
        if penalty_s < 0:
            raise ValueError(f"penalty_s must be >= 0, got {penalty_s}")
        self._penalty = penalty_s
        self._now = now
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, address: str) -> None:
        """A transfer to `address` failed or timed out: read its replicas last for a while."""
        if self._penalty:
            with self._lock:
                self._until[address] = self._now() + self._penalty

    def succeeded(self, address: str) -> None:
        if self._until:  # the common case (no sick peer) takes no lock
            with self._lock:
                self._until.pop(address, None)

    def suspect(self, address: str) -> bool:
        if not self._until:
            return False
        with self._lock:
            until = self._until.get(address)
            if until is None:
                return False
            if until <= self._now():
                del self._until[address]
                return False
            return True

    def order(self, replicas: Sequence[R]) -> Sequence[R]:
        """`replicas` with those on suspect peers moved to the end (otherwise in order)."""
        if not self._until or len(replicas) < 2:
            return replicas
        sick = [self.suspect(r.peer.address) for r in replicas]
        if not any(sick):
            return replicas
        return ([r for r, s in zip(replicas, sick, strict=True) if not s]
                + [r for r, s in zip(replicas, sick, strict=True) if s])
