"""Memory reused across KV loads: decode's KV tensors and the staging buffers blocks are read into.

Why: the first write to fresh memory page-faults every 4 KiB. Loading a 2,880-token prompt's
KV (133 MB of SmolLM2 fp32) into a fresh `torch.empty` ran at 1.5-2 GB/s on the 2-core dev VM
against 7-8 GB/s into memory touched before, and freeing it again costs ~10 ms (munmap). glibc
hands such big allocations straight back to the kernel, so without reuse every admission pays
for both. Both pools are bounded, so they hold at most what the engine was going to use anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


class SpareKV:
    """Released decode KV tensors (`[layer, k|v, kv_head, tokens, head_dim]`), kept for the next
    admission. Not thread-safe: the engine's thread owns it.

    A request takes the smallest spare with room for its tokens and at most half as many again
    (a short sequence does not tie up a long one's memory, and a running sequence holds at
    most 1.5x the memory the engine accounts for it), else a new tensor. Spares and the
    running sequences' tensors together stay within `limit_bytes` (the engine's KV budget): a
    spare that would break it is dropped, oldest first. On a GPU the caching allocator already
    reuses memory, so the engine keeps no spares there (`enabled=False`).
    """

    def __init__(self, new: Callable[[int], torch.Tensor], limit_bytes: int,
                 enabled: bool = True) -> None:
        self._new = new
        self._limit = limit_bytes
        self._enabled = enabled
        self._spare: list[torch.Tensor] = []

    @property
    def spare_bytes(self) -> int:
        return sum(t.nbytes for t in self._spare)

    def take(self, tokens: int) -> torch.Tensor:
        """A tensor with room for at least `tokens` tokens (its contents are garbage)."""
        most = tokens + tokens // 2
        fits = [i for i, t in enumerate(self._spare) if tokens <= t.shape[3] <= most]
        if not fits:
            return self._new(tokens)
        return self._spare.pop(min(fits, key=lambda i: self._spare[i].shape[3]))

    def give(self, kv: torch.Tensor, live_bytes: int) -> None:
        """Keep `kv` (no longer used) while it fits beside `live_bytes` of running tensors."""
        if not self._enabled:
            return
        self._spare.append(kv)
        total = self.spare_bytes + live_bytes
        while self._spare and total > self._limit:
            total -= self._spare.pop(0).nbytes


class Staging:
    """Grow-only byte buffers that KV blocks are read into before the engine imports them,
    shared by the threads loading requests (thread-safe). A buffer goes back once the engine
    has copied the KV out; at most `keep` buffers and `limit_bytes` are kept, the largest."""

    def __init__(self, keep: int = 2, limit_bytes: int = 1 << 30) -> None:
        self._keep = keep
        self._limit = limit_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes` bytes (uint8; contents are garbage)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:  # by index: == on arrays compares elements
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            del self._free[self._keep:]
            while self._free and sum(b.nbytes for b in self._free) > self._limit:
                self._free.pop()
