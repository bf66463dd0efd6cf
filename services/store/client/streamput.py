"""Puts whose bytes arrive in pieces while they are being computed (layer-wise KV streaming).

A prefill knows which blocks it will store before it computes them, and each layer of a block
is one contiguous byte range of the block's encoding (header + `[layer, k|v, head, token, d]`).
`StreamPut` leases the space for all of them up front (space leases naming the destination
segments, as `spacewriter` does for whole puts), and a background sender writes each range
to every replica as soon as the caller says it is final (`ready`): a same-host replica is a
shared-memory copy, another host's goes over TCP, and both overlap the caller's next layer.
Once every byte is sent (the block headers last: they hold the payload's checksum), `finish`
checksums each object over its full bytes (xxh3-64, what the store verifies on every read)
and publishes them all with one `PutCommit` per lease.

Several writers (a pipeline group's stages, each computing some layers of every block): the
leader's `plan()` leases at once and describes where every byte goes (`plan`); the other
writers write their ranges into every replica with `planwrite.PlanWriter`, and once they say
they are done the leader reads those ranges back from its nearest replica (`fill_remote`, shared
memory on its own host) so that its views hold the whole objects, writes the headers and
`finish`es as above. Only ranges either sent here or filled from a replica count: an object
with a byte neither wrote is never committed.

Nothing here is allowed to lose or corrupt a put: an object is visible only once committed
with the checksum of the bytes written. Any failure (no lease, a node gone mid-stream, a lease
lost to a master restart or its expiry) leaves the failed objects uncommitted and reports them;
the caller then puts them the plain way (`StoreClient.batch_put`). Leased space that was not
committed is released (or lapses at the lease's ttl).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import (
    InvalidArgument,
    ObjectExists,
    StoreError,
    TransferError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.client import _PLACEMENTS, StoreClient
from mooncake_k8s.store.client.plan import PlanObject, PlanReplica, encode_plan
from mooncake_k8s.store.wire import code_error, located
from mooncake_k8s.transfer import Peer, ReadOp, Tier, WriteOp

log = logging.getLogger(__name__)

LEASE_MAX = 32 << 20
"""Objects are packed into extents of at most this many bytes (a single larger object gets
one of its own): a long prompt's KV then needs no single huge free range on a segment."""
_KEEPALIVE_SHARE = 0.3
"""An empty PutCommit renews each lease after this share of its ttl: a long prefill (many
seconds on a CPU) never outlives its space."""


class StreamFailed(StoreError):
    """The stream could not store this object; put it the plain way."""


@dataclass
class _Lease:
    segments: tuple[str, ...]
    objects: list[int]  # object indexes, in offset order
    size: int = 0
    lease_id: int = 0
    replicas: tuple[tuple[Peer, Any, int], ...] = ()  # (peer, segment desc, extent start)
    ttl_s: float = 0.0
    touched: float = 0.0
    offsets: dict[int, int] = field(default_factory=dict)


_STOP = None


class StreamPut:
    """One streamed put of `keys` (their final bytes will be `views`, filled by the caller in
    any order). `segments[i]` names the segments object i gets a replica on (one on each, as
    `batch_put(segments=...)`; empty = the client's placement); `tenant` whose quota they
    count against, as for `batch_put`. Use: `ready(i, start, end)` as
    ranges become final (each byte once, any order), then `finish()`; or `abort()`."""

    def __init__(
        self,
        client: StoreClient,
        keys: Sequence[str],
        views: Sequence[Any],
        segments: Sequence[Sequence[str]],
        *,
        placement: str = "local_first",
        preferred_segment: str = "",
        tenant: str = "",
    ) -> None:
        if not len(keys) == len(views) == len(segments):
            raise InvalidArgument("keys, views and segments differ in length")
        if placement not in _PLACEMENTS:
            raise InvalidArgument(f"placement must be one of {sorted(_PLACEMENTS)}")
        self._client = client
        self.keys = list(keys)
        self.views = [byte_view(v) for v in views]
        if any(len(v) == 0 for v in self.views):
            raise InvalidArgument("the store keeps objects of >= 1 byte")
        self._placement = _PLACEMENTS[placement]
        self._preferred = preferred_segment
        self._tenant = tenant
        self._leases = self._pack([tuple(dict.fromkeys(s for s in seg if s))
                                   for seg in segments])
        self._where: dict[int, _Lease] = {i: ls for ls in self._leases for i in ls.objects}
        self._queue: queue.SimpleQueue[tuple[int, int, int, Any] | None] = queue.SimpleQueue()
        self.error: Exception | None = None
        self._done: list[list[tuple[int, int]]] = [[] for _ in self.keys]
        """Ranges of each object in every replica: sent from here or filled from a replica."""
        self.bytes_filled = 0
        """Bytes `fill_remote` read back (other writers' ranges)."""
        self._lease_lock = threading.Lock()
        self._leased = False
        self._thread = threading.Thread(target=self._run, name="kv-stream", daemon=True)
        self._thread.start()

    def _pack(self, segs: list[tuple[str, ...]]) -> list[_Lease]:
        """Objects grouped by their segments, in extents of at most LEASE_MAX bytes."""
        leases: list[_Lease] = []
        open_: dict[tuple[str, ...], _Lease] = {}
        for i, seg in enumerate(segs):
            n = _align(len(self.views[i]))
            cur = open_.get(seg)
            if cur is None or (cur.size and cur.size + n > LEASE_MAX):
                cur = _Lease(seg, [])
                open_[seg] = cur
                leases.append(cur)
            cur.offsets[i] = cur.size
            cur.objects.append(i)
            cur.size += n
        return leases

    # -- the caller's side -------------------------------------------------------------------

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        """Bytes [start, end) of object `index` are final in its view (or will be once
        `event`, a CUDA event, completes): send them."""
        self._check(index, start, end)
        self._queue.put((index, start, end, event))

    def _check(self, index: int, start: int, end: int) -> None:
        if not 0 <= index < len(self.views):
            raise InvalidArgument(f"object index {index} outside 0..{len(self.views) - 1}")
        if not 0 <= start < end <= len(self.views[index]):
            raise InvalidArgument(f"range [{start}, {end}) outside object {index} "
                                  f"of {len(self.views[index])} bytes")

    def plan(self) -> bytes:
        """Lease every object's space now (blocking) and describe where each of its bytes
        goes (`plan`), for `PlanWriter`s in other processes. The leases stay alive (the
        sender's keepalive) until `finish` or `abort`. Raises StreamFailed when the space
        cannot be leased (the caller stores nothing through this stream)."""
        self._ensure_leased()
        if self.error is not None:
            raise StreamFailed(f"leasing the stream's space failed: {self.error}")
        objects = []
        for i, view in enumerate(self.views):
            lease = self._where[i]
            objects.append(PlanObject(len(view), tuple(
                PlanReplica(peer, desc, base + lease.offsets[i])
                for peer, desc, base in lease.replicas)))
        return encode_plan(objects)

    def fill_remote(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Read (object index, start, end) ranges that other writers wrote into the replicas
        (`PlanWriter`) back into our views, each from its nearest replica that answers
        (shared memory on this host first). They then count as written for `finish`. Raises
        InvalidArgument for a range outside its object, StreamFailed when no replica of a
        range could be read (or the stream failed already)."""
        items = [(int(i), int(s), int(e)) for i, s, e in ranges]
        for i, s, e in items:
            self._check(i, s, e)
        self._ensure_leased()
        if self.error is not None:
            raise StreamFailed(f"streaming failed: {self.error}")
        failed: dict[str, Exception] = {}
        left = items
        while left:
            by_peer: dict[str, tuple[Peer, list[tuple[int, int, int]], list[ReadOp]]] = {}
            for i, s, e in left:
                rep = next((r for r in self._nearest(i) if r[0].address not in failed), None)
                if rep is None:
                    why = "; ".join(f"{a}: {err}" for a, err in failed.items())
                    raise StreamFailed(f"no replica of object {i} could be read: {why}")
                peer, desc, base = rep
                got = by_peer.setdefault(peer.address, (peer, [], []))
                got[1].append((i, s, e))
                got[2].append(ReadOp(desc, base + self._where[i].offsets[i] + s,
                                     self.views[i][s:e]))
            left = []
            for peer, batch, ops in by_peer.values():
                try:
                    self._client.engine.read(peer, ops)
                except TransferError as err:
                    self._client._failed(peer)
                    failed[peer.address] = err
                    left.extend(batch)
                    continue
                for i, s, e in batch:
                    self._done[i].append((s, e))
                    self.bytes_filled += e - s

    def _nearest(self, index: int) -> list[tuple[Peer, Any, int]]:
        """The replicas of object `index`, nearest first: healthy before suspect, this host's
        before others, DRAM before SSD."""
        c = self._client
        return sorted(self._where[index].replicas, key=lambda r: (
            c._health.suspect(r[0].address), r[0].host_id != c._host_id, r[1].tier != Tier.DRAM))

    def finish(self, skip: Sequence[int] = ()) -> list[Exception | None]:
        """Publish every object but those in `skip` (their space is released): a result per
        object, None for committed, ObjectExists when it was stored already, StreamFailed
        when the caller must put it the plain way (so are `skip`ped ones, and any object
        whose bytes were not all made `ready`: it is never committed half-written)."""
        self._queue.put(_STOP)
        self._thread.join()
        if self.error is not None:
            self._release_all()
            return [StreamFailed(f"streaming failed: {self.error}")] * len(self.keys)
        results: list[Exception | None] = [StreamFailed("skipped")] * len(self.keys)
        skipped = set(skip)
        for i, done in enumerate(self._done):
            gap = _gap(done, len(self.views[i]))
            if gap and i not in skipped:
                skipped.add(i)
                results[i] = StreamFailed(f"object {i}: {gap}")
        for lease in self._leases:
            self._commit(lease, skipped, results)
        return results

    def abort(self) -> None:
        """Give up: nothing is committed and the leased space is released."""
        self.error = self.error or StreamFailed("aborted")
        self._queue.put(_STOP)
        self._thread.join()
        self._release_all()

    # -- the sender thread --------------------------------------------------------------------

    def _ensure_leased(self) -> None:
        """Lease every extent once, from whichever thread asks first (the sender as it
        starts, or `plan`); a failure is the stream's error."""
        with self._lease_lock:
            if self._leased:
                return
            self._leased = True
            try:
                for lease in self._leases:
                    self._lease(lease)
            except Exception as e:  # no space, no master, bad segment: the plain path decides
                self.error = self.error or e

    def _run(self) -> None:
        self._ensure_leased()
        while True:
            timeout = self._next_keepalive()
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                self._keepalive()
                continue
            batch = [item]
            while item is not _STOP and not self._queue.empty():
                item = self._queue.get()
                batch.append(item)
            if self.error is None:
                self._send([b for b in batch if b is not None])
            if batch[-1] is _STOP:
                return
            if self.error is None and (self._next_keepalive() or 0.0) <= 0:
                self._keepalive()

    def _next_keepalive(self) -> float | None:
        if self.error is not None or not self._leases:
            return None
        due = min(ls.touched + _KEEPALIVE_SHARE * ls.ttl_s for ls in self._leases)
        return max(0.0, due - time.monotonic())

    def _keepalive(self) -> None:
        now = time.monotonic()
        for lease in self._leases:
            if now >= lease.touched + _KEEPALIVE_SHARE * lease.ttl_s:
                try:
                    self._client._call("PutCommit", pb.PutCommitRequest(lease_id=lease.lease_id))
                except StoreError as e:
                    self.error = e
                    return
                lease.touched = now

    def _lease(self, lease: _Lease) -> None:
        c = self._client
        replicas = max(c.replicas, len(lease.segments), 1)
        preferred = self._preferred or (lease.segments[-1] if lease.segments else "")
        placement = pb.PREFERRED if preferred else self._placement
        sent = time.monotonic()
        resp = c._call("SpaceLease", pb.SpaceLeaseRequest(
            size=lease.size, min_size=lease.size, replicas=replicas, placement=placement,
            preferred_segment=preferred, client_host_id=c._host_id,
            segments=list(lease.segments), tenant=self._tenant,
        ))
        if resp.size < lease.size:
            raise StoreError(f"leased {resp.size} bytes, {lease.size} needed")
        if (resp.align or 64) > 64:  # our offsets assume the master's 64-byte alignment
            raise StoreError(f"space lease alignment {resp.align} is not supported")
        lease.lease_id = resp.lease_id
        lease.replicas = tuple(located(r) for r in resp.replicas)
        lease.ttl_s = resp.ttl_ms / 1000.0
        lease.touched = sent

    def _send(self, items: list[tuple[int, int, int, Any]]) -> None:
        """Write every range to every replica of its object: one transfer call per peer."""
        for _, _, _, event in items:
            if event is not None:
                event.synchronize()
        by_peer: dict[str, tuple[Peer, list[WriteOp]]] = {}
        for i, start, end, _ in items:
            lease = self._where[i]
            off = lease.offsets[i] + start
            src = self.views[i][start:end]
            for peer, desc, base in lease.replicas:
                by_peer.setdefault(peer.address, (peer, []))[1].append(
                    WriteOp(desc, base + off, src))
        for peer, ops in by_peer.values():
            try:
                self._client.engine.write(peer, ops)
            except TransferError as e:
                self._client._failed(peer)
                self.error = e
                return
        for i, start, end, _ in items:
            self._done[i].append((start, end))

    # -- finishing ----------------------------------------------------------------------------

    def _commit(self, lease: _Lease, skipped: set[int], results: list[Exception | None]) -> None:
        items = [i for i in lease.objects if i not in skipped]
        req = pb.PutCommitRequest(lease_id=lease.lease_id, release=True, items=[
            pb.CommitItem(key=self.keys[i], offset=lease.offsets[i], size=len(self.views[i]),
                          checksum=checksum(self.views[i])) for i in items])
        try:
            resp = self._client._call("PutCommit", req)
        except StoreError as e:
            for i in items:
                results[i] = StreamFailed(f"publishing {self.keys[i]!r}: {e}")
            return
        for i, msg, code in zip(items, resp.errors, resp.codes, strict=False):
            if code == pb.ERROR_NONE and not msg:
                results[i] = None
            elif code == pb.ERROR_EXISTS:
                results[i] = ObjectExists(f"object {self.keys[i]!r} exists")
            else:
                err = code_error(code, f"put {self.keys[i]!r}: {msg}")
                results[i] = StreamFailed(str(err))

    def _release_all(self) -> None:
        for lease in self._leases:
            if lease.lease_id:
                with contextlib.suppress(StoreError):
                    self._client._call("SpaceRelease",
                                       pb.SpaceReleaseRequest(lease_id=lease.lease_id))
                lease.lease_id = 0


def _gap(done: list[tuple[int, int]], size: int) -> str:
    """What is wrong with ranges `done` as a cover of [0, size): "" when they cover it once."""
    pos = 0
    for start, end in sorted(done):
        if start > pos:
            return f"bytes [{pos}, {start}) of {size} were never written"
        if start < pos:
            return f"bytes [{start}, {min(pos, end)}) were written twice"
        pos = end
    return "" if pos == size else f"bytes [{pos}, {size}) of {size} were never written"


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a
