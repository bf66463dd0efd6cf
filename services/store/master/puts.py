"""The classic two-phase put: `put_start` allocates, the writer writes, `put_end` publishes.

A part of `state.MasterState` (run under its lock), owning the pending puts. Most puts now take
one round trip through a space lease (`spaces`); this path serves puts too large for an extent,
`most_free` placement (spread object by object), and puts whose lease was lost.

Lifecycle of an object::

    put_start ──> pending (space allocated, invisible) ──put_end──> committed (visible)
                      └──put_revoke / timeout / node death──> space freed

A pending put claims its key for a short time (`put_claim_s`, longer for big objects): other
writers of the key are told it exists, so concurrent writers of one block do not all write it.
A writer that crashes therefore blocks its key only until the claim lapses, not for the whole
put timeout: after that a new put of the key runs beside the old one, the first `put_end`
publishes, and a later one is refused as superseded (`PutSuperseded`) with its space freed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from mooncake_k8s.common.errors import (
    InvalidArgument,
    NoSpace,
    ObjectExists,
    ObjectTooLarge,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.quotas import TenantQuotas
from mooncake_k8s.store.master.records import Node, Pending, check_key, rep_pb
from mooncake_k8s.store.master.tiering import TierPolicy
from mooncake_k8s.store.wire import code_of

log = logging.getLogger(__name__)

MAX_REPLICAS = 8


class PutNotFound(StoreError, LookupError):
    """The put id is unknown: never issued, already ended, revoked, or timed out."""


class PutSuperseded(ObjectExists):
    """Another put of the same key ended first (this put's claim had lapsed); the object is
    stored, this put's space is freed. For the writer that is as good as ObjectExists, and
    it answers as one (ERROR_EXISTS)."""


#: A claim lasts put_claim_s plus the time to write the object's replicas at this rate, so a
#: large put by a live writer keeps its key while small ones lapse fast after a crash. Too
#: short only costs a duplicate write (the keys name their content), never a failure.
CLAIM_BYTES_PER_S = 256 << 20


def check_put(size: int, replicas: int, placement: int, max_object_size: int,
              segments: Sequence[str] = ()) -> int:
    """Validate a put's (or a space lease's) shape; returns the replica count (0 means 1)."""
    if replicas == 0:
        replicas = 1
    if not 1 <= replicas <= MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be 1..{MAX_REPLICAS}, got {replicas}")
    if len(segments) > MAX_REPLICAS:
        raise InvalidArgument(
            f"segments names {len(segments)} segments; at most {MAX_REPLICAS} replicas")
    if size < 1:
        raise InvalidArgument("size must be >= 1 (the store keeps no empty objects)")
    if size > max_object_size:
        raise ObjectTooLarge(
            f"object of {size} bytes is too large: the limit is {max_object_size}"
        )
    if placement not in (pb.PLACEMENT_UNSPECIFIED, pb.LOCAL_FIRST, pb.PREFERRED, pb.MOST_FREE):
        raise InvalidArgument(f"unknown placement {placement}")
    return replicas


class ClassicPuts:
    """`put_start` / `put_end` / `put_revoke` and their batch forms, and the pending puts they
    keep; see the module docstring."""

    def __init__(self, catalog: Catalog, tiers: TierPolicy, quotas: TenantQuotas, *,
                 max_object_size: int,
                 put_timeout_s: float, put_claim_s: float) -> None:
        self._cat = catalog
        self._tiers = tiers
        self._quotas = quotas
        self.max_object_size = max_object_size
        self.put_timeout_s = put_timeout_s
        self.put_claim_s = put_claim_s
        self.pending: OrderedDict[int, Pending] = OrderedDict()  # deadline order
        self._pending_keys: dict[str, int] = {}

    def put_start(
        self,
        key: str,
        size: int,
        replicas: int = 1,
        placement: int = pb.LOCAL_FIRST,
        preferred_segment: str = "",
        client_host_id: str = "",
        segments: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.PutStartResponse:
        """Allocate space for a new object. `exists=True` (put_id 0) when the key is already
        stored, or (with `in_progress`) another put of it holds a live claim on the key.
        `segments`: one replica on each, see `TierPolicy.place`. `tenant`: whose quota it
        counts against (QuotaExceeded when it is full of what it cannot evict)."""
        check_key(key)
        replicas = check_put(size, replicas, placement, self.max_object_size, segments)
        with self._cat.op():
            if key in self._cat.objects:
                return pb.PutStartResponse(exists=True)
            now = self._cat.now()
            claimant = self.pending.get(self._pending_keys.get(key, 0))
            if claimant is not None:
                if claimant.claim_until > now:
                    return pb.PutStartResponse(exists=True, in_progress=True)
                log.info(
                    "put claim lapsed: another writer takes the key over",
                    extra={"key": key, "put_id": claimant.put_id},
                )
            self._quotas.admit(tenant, size, max(replicas, len(segments)))
            reps = self._tiers.place(size, replicas, placement, preferred_segment, client_host_id,
                                     segments=segments)
            put_id = self._cat.new_id()
            claim = min(self.put_timeout_s,
                        self.put_claim_s + size * len(reps) / CLAIM_BYTES_PER_S)
            self.pending[put_id] = Pending(
                put_id, key, size, reps, now + self.put_timeout_s, now + claim, tenant
            )
            self._pending_keys[key] = put_id
            return pb.PutStartResponse(put_id=put_id, replicas=[rep_pb(r) for r in reps])

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        """Publish a written object: from now on lookups see it."""
        if not 0 <= checksum < 1 << 64:  # (gRPC gives a uint64; in-process callers may not)
            raise InvalidArgument(f"checksum must be an unsigned 64-bit integer, got {checksum}")
        with self._cat.op():
            put = self.pending.get(put_id)
            if put is None:
                raise PutNotFound(
                    f"put {put_id} is unknown: already ended, revoked, timed out, or its node died"
                )
            if put.key != key:
                raise InvalidArgument(f"put {put_id} is for another key")
            if key in self._cat.objects:
                self.end_pending(put)
                raise PutSuperseded(
                    f"object {key!r} was stored by another writer whose put ended first "
                    f"(the claim of put {put_id} had lapsed); nothing more to write"
                )
            self.end_pending(put, free=False)
            self._cat.publish(key, put.size, checksum, put.reps)
            self._quotas.published(key, put.tenant)

    def put_revoke(self, key: str, put_id: int) -> None:
        """Abandon a put; its space is freed."""
        with self._cat.op():
            put = self.pending.get(put_id)
            if put is None:
                raise PutNotFound(f"put {put_id} is unknown: already ended, revoked or timed out")
            if put.key != key:
                raise InvalidArgument(f"put {put_id} is for another key")
            self.end_pending(put)

    def end_pending(self, put: Pending, free: bool = True) -> None:
        self.pending.pop(put.put_id, None)
        if self._pending_keys.get(put.key) == put.put_id:
            del self._pending_keys[put.key]
        if free:
            for rep in put.reps:
                if rep.seg.alive:
                    rep.seg.alloc.free(rep.offset, put.size)

    def batch_put_start(self, items: Sequence[pb.PutStartRequest]) -> list[pb.PutStartResult]:
        """`put_start` of each item; a refusal (too large, invalid, no space) is answered in
        the item's result with its `ErrorCode`, anything else fails the call."""
        out = []
        for it in items:
            try:
                ok = self.put_start(
                    it.key, it.size, it.replicas, it.placement, it.preferred_segment,
                    it.client_host_id, it.segments, it.tenant,
                )
                out.append(pb.PutStartResult(ok=ok))
            except (InvalidArgument, NoSpace) as e:  # ObjectTooLarge is an InvalidArgument
                out.append(pb.PutStartResult(error=str(e), code=code_of(e)))
        return out

    def batch_put_end(self, items: Sequence[pb.PutEndRequest]) -> pb.BatchPutEndResponse:
        """`put_end` of each item; an error message and `ErrorCode` per item ("" and
        ERROR_NONE when it ended): ERROR_EXISTS when superseded, ERROR_NOT_FOUND for an unknown
        put, ERROR_INVALID."""
        errors: list[str] = []
        codes: list[pb.ErrorCode] = []
        for it in items:
            try:
                self.put_end(it.key, it.put_id, it.checksum)
                errors.append("")
                codes.append(pb.ERROR_NONE)
            except (StoreError, InvalidArgument) as e:
                errors.append(str(e))
                codes.append(code_of(e))
        return pb.BatchPutEndResponse(errors=errors, codes=codes)

    # -- for the other parts -----------------------------------------------------------------

    def claimed(self, key: str) -> bool:
        """Whether a put of `key` is in progress (its inventory copy may not be restored)."""
        return key in self._pending_keys

    def expire(self, now: float) -> None:
        """End puts past their deadline (they are kept in deadline order)."""
        while self.pending:
            put = next(iter(self.pending.values()))
            if put.deadline > now:
                break
            log.info("put timed out", extra={"key": put.key, "put_id": put.put_id})
            self.end_pending(put)

    def cancel_on(self, node: Node, why: str = "") -> None:
        """End every put writing to `node` (it died or restarted: the bytes are gone); `why`,
        when given, is logged for each."""
        for put in [p for p in self.pending.values() if any(r.seg.node is node for r in p.reps)]:
            if why:
                log.info(why, extra={"key": put.key, "put_id": put.put_id,
                                     "node_id": node.node_id})
            self.end_pending(put)
