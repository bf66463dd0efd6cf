"""PeerHealth: which replica a client reads first once a peer failed a transfer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mooncake_k8s.store.client.failover import PeerHealth


@dataclass(frozen=True)
class P:
    address: str


@dataclass(frozen=True)
class R:
    peer: P


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_failed_peer_is_read_last_until_its_penalty_ends() -> None:
    clock = Clock()
    h = PeerHealth(5.0, now=clock)
    reps = [R(P("a:1")), R(P("b:1")), R(P("c:1"))]
    assert h.order(reps) is reps  # nothing failed: untouched, no copy
    h.failed("a:1")
    assert [r.peer.address for r in h.order(reps)] == ["b:1", "c:1", "a:1"]
    h.failed("b:1")
    assert [r.peer.address for r in h.order(reps)] == ["c:1", "a:1", "b:1"]
    h.succeeded("b:1")  # a success clears the mark at once
    assert [r.peer.address for r in h.order(reps)] == ["b:1", "c:1", "a:1"]
    clock.t += 5.1
    assert h.order(reps) == reps and not h.suspect("a:1")


def test_zero_penalty_disables_and_negative_is_rejected() -> None:
    h = PeerHealth(0.0)
    h.failed("a:1")
    assert not h.suspect("a:1")
    with pytest.raises(ValueError, match="penalty_s"):
        PeerHealth(-1)
