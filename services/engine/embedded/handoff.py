"""A live decode stream handed over through the pool (drain): the store side.

The engine thread exports the stream's context KV as blocks at a step boundary (`Engine.export`)
and drops the sequence; the stream's own thread then writes them here, so the batch never waits
on the store. Full blocks go under their usual keys (a later prefill of the same text reuses
them), the partial last block under a request-scoped tail key that the resuming decode removes
after loading it (as after a prefill).

The instance handing over is going away, and with it its own DRAM segment (`avoid`): a block
whose only copy lives there is as good as missing, so it is written again on another segment.
Blocks another copy of which survives are left alone (counted "present").
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_k8s.common.errors import ObjectExists, StoreError
from mooncake_k8s.engine.api import Handoff, KVStore


def handoff_tail_key(request_id: str) -> str:
    """The tail object of a handed-over stream: apart from the prefill's `tail/<id>`."""
    return f"tail/{request_id}/handoff"


@dataclass
class HandoffCounts:
    """What handoffs wrote, for the worker's metrics."""

    written: int = 0
    """Blocks (tails included) written to the pool."""
    present: int = 0
    """Full blocks already in the pool off this instance (not written)."""


def _segment_names(info: Any) -> list[str]:
    return [loc.segment.name for loc in info.replicas]


def surviving_prefix(store: KVStore, keys: Sequence[str], avoid: str) -> int:
    """How many leading keys have a copy on a segment other than `avoid` (a store without
    `locate` is asked nothing: 0, so every block is written)."""
    locate = getattr(store, "locate", None)
    if locate is None or not keys:
        return 0
    try:
        infos = locate(list(keys))
    except StoreError:
        return 0
    n = 0
    for info in infos:
        if info is None or not any(s != avoid for s in _segment_names(info)):
            break
        n += 1
    return n


def _put(store: KVStore, items: list[tuple[str, bytes]], segment: str,
         tenant: str) -> list[Exception | None]:
    if not items:
        return []
    return store.batch_put([k for k, _ in items], [d for _, d in items], placement="most_free",
                           segments=[segment] if segment else [], tenant=tenant)


def _only_on(store: KVStore, keys: list[str], avoid: str) -> list[bool]:
    """Per key: whether every copy of it is on `avoid` (or it vanished meanwhile)."""
    locate = getattr(store, "locate", None)
    if locate is None or not avoid:
        return [False] * len(keys)
    return [info is None or all(s == avoid for s in _segment_names(info))
            for info in locate(keys)]


def write_handoff(store: KVStore, keys: Sequence[str], blocks: list[tuple[int, bytes]],
                  tail: tuple[str, bytes] | None, context_tokens: int, segment: str, avoid: str,
                  tenant: str, counts: HandoffCounts) -> Handoff:
    """Write a handed-over stream's blocks (`keys`: every full block's key of its context;
    `blocks`: (index, encoding) of those to write, the others being present elsewhere) and its
    tail; raises StoreError when one cannot be stored (the stream then fails over instead)."""
    items = [(keys[i], data) for i, data in blocks]
    if tail is not None:
        with contextlib.suppress(StoreError):  # a leftover of an earlier try: ours replaces it
            store.remove([tail[0]], force=True)
        items.append(tail)
    results = _put(store, items, segment, tenant)
    exists = [i for i, r in enumerate(results) if isinstance(r, ObjectExists)]
    again = [i for i, only in zip(exists, _only_on(store, [items[i][0] for i in exists], avoid),
                                  strict=True) if only]
    if again:  # its one copy leaves with this instance: put ours elsewhere instead
        store.remove([items[i][0] for i in again], force=True)
        for i, r in zip(again, _put(store, [items[i] for i in again], segment, tenant),
                        strict=True):
            results[i] = r
    for (key, _), r in zip(items, results, strict=True):
        if r is not None and not isinstance(r, ObjectExists):
            raise StoreError(f"handing over: storing {key}: {r}") from r
    written = sum(r is None for r in results)
    counts.written += written
    full_written = written - (tail is not None and results[-1] is None)
    counts.present += len(keys) - full_written
    return Handoff(context_tokens, tail[0] if tail is not None else "", len(keys))
