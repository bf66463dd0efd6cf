"""The writer's side of space leases (`spaces`): a put that costs one master round trip.

`StoreClient` keeps one leased extent per put shape (replica count, placement, preferred
segment, named segments). A put carves its objects from that extent under a lock (offsets only,
no I/O), writes their bytes to every replica outside the lock, then publishes them with one
`PutCommit`. Only when the extent is used up or near its expiry does a put first take a new
lease (one more round trip, amortised over the extent's objects).

An extent is *retired* when a new one replaces it; its unused rest is freed by the master when
its last in-flight put commits with `release` (or it lapses), never while a put may still be
writing into it, since freed space may go to another writer at once.

What the master refuses here is never lost: objects whose lease is gone (`NOT_FOUND`: the
master changed, the node restarted, the lease lapsed) come back as `RETRY`, and the client
puts them again the classic way. A master without space leases (older release) answers the
first lease with an error; the writer then stays off for a while and the classic path serves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.common.errors import (
    InvalidArgument,
    MasterUnavailable,
    NoSpace,
    ObjectTooLarge,
    StoreError,
    TransferError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.wire import code_error
from mooncake_k8s.transfer import Peer, WriteOp

RETRY = object()
"""A result: put this object again the classic way (its lease was gone at commit)."""
LEASE_BYTES = 32 << 20
"""What a writer asks for when it needs a new extent (the master may grant less)."""
MAX_BATCH = 64 << 20
"""Puts larger than this (all objects of a batch together) take the classic path."""
_USE_SHARE = 0.5
"""An extent is used only within this share of its ttl since it was granted or last used, so
it never lapses while a put writes into it."""
_OFF_S = 60.0


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class _Extent:
    lease_id: int
    size: int
    align: int
    starts: tuple[tuple[Peer, Any, int], ...]  # (peer, segment desc, extent offset) per replica
    ttl_s: float
    valid_until: float
    cursor: int = 0
    inflight: int = 0
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


Shape = tuple[int, int, str, tuple[str, ...], str]
"""(replicas, placement, preferred segment, named segments, tenant): puts of one shape share
an extent (an extent's objects all count against its tenant's quota)."""


class SpaceWriter:
    """Puts through leased extents; thread-safe. `call(method, request)` is the client's
    master call, `write(peer, ops)` its checksummed write to one peer (TransferError marks the
    peer failed), `locate(replica)` turns a `pb.Replica` into (peer, segment desc, offset)."""

    def __init__(
        self,
        call: Callable[[str, Any], Any],
        write: Callable[[Peer, list[WriteOp]], list[int]],
        locate: Callable[[pb.Replica], tuple[Peer, Any, int]],
        host_id: str,
        lease_bytes: int = LEASE_BYTES,
    ) -> None:
        self._call = call
        self._write = write
        self._locate = locate
        self._host_id = host_id
        self.lease_bytes = lease_bytes
        self._lock = threading.Lock()
        self._extents: dict[Shape, _Extent] = {}
        self._off_until = 0.0

    @property
    def enabled(self) -> bool:
        return self.lease_bytes > 0 and time.monotonic() >= self._off_until

    def put(
        self, keys: Sequence[str], views: Sequence[memoryview], shape: Shape
    ) -> list[Any] | None:
        """Put `keys`: a result per key (None stored, an exception, or `RETRY`), or None when
        this path cannot take the batch at all (the caller uses the classic path)."""
        sizes = [len(v) for v in views]
        need = sum(_align(n, 64) for n in sizes)
        if (not self.enabled or need > MAX_BATCH or not sizes or min(sizes) < 1
                or shape[1] == pb.MOST_FREE):  # spreads object by object: classic puts
            return None
        got = self._carve(shape, sizes, need)
        if got is None:
            return None
        ext, offsets = got
        results: list[Any] = [None] * len(keys)
        written = self._write_all(shape, ext, views, offsets, results)
        items = [pb.CommitItem(key=keys[i], offset=offsets[i], size=sizes[i], checksum=s)
                 for i, s in written]
        sent = time.monotonic()
        try:
            resp = self._call("PutCommit", pb.PutCommitRequest(
                lease_id=ext.lease_id, items=items)) if items else None
        except StoreError as e:
            for i, _ in written:
                results[i] = StoreError(f"publishing {keys[i]!r}: {e}")
            self._retire(shape, ext)
            return results
        finally:
            self._done(ext)
        if resp is None:
            return results
        ext.valid_until = max(ext.valid_until, sent + _USE_SHARE * ext.ttl_s)
        lost = False
        for (i, _), msg, code in zip(written, resp.errors, resp.codes, strict=False):
            if code == pb.ERROR_NOT_FOUND:
                results[i] = RETRY
                lost = True
            elif code != pb.ERROR_NONE:
                results[i] = code_error(code, f"put {keys[i]!r}: {msg}")
        if lost:
            self._retire(shape, ext)
        return results

    def _write_all(
        self, shape: Shape, ext: _Extent, views: Sequence[memoryview], offsets: list[int],
        results: list[Any],
    ) -> list[tuple[int, int]]:
        """Write every object to every replica; (index, checksum) of those fully written. A
        replica whose peer failed (partitioned, gone) retires the extent: the next put leases
        anew instead of failing on that peer again until the extent is used up."""
        sums: dict[int, int] = {}
        failed: set[int] = set()
        for peer, seg, base in ext.starts:
            ops = [WriteOp(seg, base + off, v) for off, v in zip(offsets, views, strict=True)]
            try:
                got = self._write(peer, ops)
            except TransferError as e:
                for i in range(len(views)):
                    failed.add(i)
                    results[i] = e
                self._retire(shape, ext)
                continue
            for i, s in enumerate(got):
                sums.setdefault(i, s)
        return [(i, sums[i]) for i in range(len(views)) if i not in failed]

    # -- extents -------------------------------------------------------------------------------

    def _carve(
        self, shape: Shape, sizes: list[int], need: int
    ) -> tuple[_Extent, list[int]] | None:
        """Offsets for `sizes` (`need` bytes, aligned) in the shape's extent, taking a new
        lease when it has no room."""
        with self._lock:
            ext = self._extents.get(shape)
            if ext is not None:
                offsets = self._take(ext, sizes)
                if offsets is not None:
                    return ext, offsets
            fresh = self._lease(shape, need)
            if fresh is None:
                return None
            if ext is not None:
                self._retire_locked(shape, ext)
            self._extents[shape] = fresh
            offsets = self._take(fresh, sizes)
            return (fresh, offsets) if offsets is not None else None

    @staticmethod
    def _take(ext: _Extent, sizes: list[int]) -> list[int] | None:
        if ext.retired or time.monotonic() >= ext.valid_until:
            return None
        offsets, pos = [], ext.cursor
        for n in sizes:
            offsets.append(pos)
            pos += _align(n, ext.align)
        if pos > ext.size:
            return None
        with ext.lock:
            ext.cursor = pos
            ext.inflight += 1
        return offsets

    def _lease(self, shape: Shape, need: int) -> _Extent | None:
        replicas, placement, preferred, segments, tenant = shape
        sent = time.monotonic()
        try:
            resp = self._call("SpaceLease", pb.SpaceLeaseRequest(
                size=max(need, self.lease_bytes), min_size=need, replicas=replicas,
                placement=placement, preferred_segment=preferred,  # type: ignore[arg-type]
                client_host_id=self._host_id, segments=segments, tenant=tenant,
            ))
        except (NoSpace, ObjectTooLarge, InvalidArgument, MasterUnavailable):
            return None  # the classic path gives each object its own error
        except StoreError:  # a master without space leases: classic puts for a while
            self._off_until = time.monotonic() + _OFF_S
            return None
        ttl = resp.ttl_ms / 1000.0
        return _Extent(
            lease_id=resp.lease_id, size=resp.size, align=resp.align or 64,
            starts=tuple(self._locate(r) for r in resp.replicas), ttl_s=ttl,
            valid_until=sent + _USE_SHARE * ttl,
        )

    def _done(self, ext: _Extent) -> None:
        """A put carved from `ext` has committed (or failed): the last one of a retired
        extent frees its rest. Never earlier: a put still writing into it would race a
        release, and the freed space may go to another writer at once."""
        with ext.lock:
            ext.inflight -= 1
            last = ext.retired and ext.inflight == 0
        if last:
            self._release_later(ext)

    def _retire(self, shape: Shape, ext: _Extent) -> None:
        with self._lock:
            self._retire_locked(shape, ext)

    def _retire_locked(self, shape: Shape, ext: _Extent) -> None:
        """Stop carving from `ext`; free its rest now if no put is writing into it."""
        if self._extents.get(shape) is ext:
            del self._extents[shape]
        with ext.lock:
            if ext.retired:
                return
            ext.retired = True
            idle = ext.inflight == 0
        if idle:
            self._release_later(ext)

    def _release_later(self, ext: _Extent) -> None:
        """SpaceRelease off the put's path (a used-up extent has nothing left to free: the
        master forgets it at expiry)."""
        if ext.cursor < ext.size:
            threading.Thread(target=self._release, args=(ext,), daemon=True,
                             name="space-release").start()

    def _release(self, ext: _Extent) -> None:
        with contextlib.suppress(StoreError):  # the master frees it at expiry anyway
            self._call("SpaceRelease", pb.SpaceReleaseRequest(lease_id=ext.lease_id))

    def close(self) -> None:
        """Release every extent no put is writing into (best effort, before the client's
        connections close; the master frees the others at expiry)."""
        with self._lock:
            extents = list(self._extents.values())
            self._extents.clear()
        for ext in extents:
            with ext.lock:
                ext.retired = True
                idle = ext.inflight == 0
            if idle and ext.cursor < ext.size:
                self._release(ext)
