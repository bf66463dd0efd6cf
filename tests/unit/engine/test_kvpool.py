"""The KV load's memory pools (engine/embedded/kvpool.py): what is reused and what is bounded."""

from __future__ import annotations

import numpy as np
import torch

from mooncake_k8s.engine.embedded.kvpool import SpareKV, Staging


def _new(tokens: int) -> torch.Tensor:
    return torch.empty(2, 2, 1, tokens, 4)


def test_spare_kv_reuses_the_smallest_fit_within_half_as_many_again() -> None:
    pool = SpareKV(_new, limit_bytes=1 << 20)
    small, big = pool.take(10), pool.take(100)
    pool.give(big, live_bytes=0)
    pool.give(small, live_bytes=0)
    assert pool.take(8) is small
    assert pool.take(60).shape[3] == 60, "100 tokens is over 1.5x 60: a new tensor"
    assert pool.take(70) is big
    assert pool.spare_bytes == 0


def test_spare_kv_stays_within_the_budget_and_keeps_nothing_when_disabled() -> None:
    per = _new(100).nbytes
    pool = SpareKV(_new, limit_bytes=3 * per)
    a, b, c = pool.take(100), pool.take(100), pool.take(100)
    pool.give(a, live_bytes=per)
    pool.give(b, live_bytes=per)
    assert pool.spare_bytes == 2 * per
    pool.give(c, live_bytes=2 * per)  # c and the live two fill it: the oldest spares go
    assert pool.spare_bytes == per and pool.take(100) is c
    off = SpareKV(_new, limit_bytes=1 << 30, enabled=False)
    t = off.take(5)
    off.give(t, live_bytes=0)
    assert off.spare_bytes == 0 and off.take(5) is not t


def test_staging_hands_back_buffers_and_keeps_the_largest() -> None:
    pool = Staging(keep=2, limit_bytes=1000)
    a, b, c = pool.take(100), pool.take(300), pool.take(600)
    assert isinstance(a, np.ndarray) and a.nbytes == 100
    for buf in (a, b, c):
        pool.give(buf)
    assert pool.take(250) is b, "the smallest that fits; the smallest buffer was dropped"
    assert pool.take(50) is c
    assert pool.take(50) is not a
    pool.give(np.empty(2000, np.uint8))
    assert pool.take(10).nbytes == 10, "over the byte limit: not kept"
