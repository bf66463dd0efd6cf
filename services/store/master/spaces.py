"""Space leases: puts that cost one master round trip.

Why: the classic put asks the master twice, `PutStart` (where do the bytes go) and `PutEnd`
(publish them). With real engines a prefill writes many small blocks (16-64 tokens each), and
the first round trip alone was what made a small put slower than Mooncake's. A writer that
holds a *space lease* already knows where its next objects go, so it writes their bytes at
once and asks the master only to publish them:

    lease_space ──> extent of N bytes on each of R nodes (one RPC, amortised over many puts)
    writer carves objects out of it (aligned offsets), writes their bytes, then
    put_commit([(key, offset, size, checksum), ...]) ──> published (one RPC per put or batch)
    space_release / expiry (ttl after the last use) / its node gone ──> unused ranges freed

Rules the master enforces, so a buggy or hostile writer can only waste its own extent:
- a committed range lies inside the extent, starts on an `ALIGN` boundary and overlaps no range
  committed from the same lease before (whatever happened to that object since);
- a key that is already stored is refused (`EXISTS`) and its range stays unused;
- a lease whose node restarted or died, or that expired or was released, is gone: commits
  against it get `NOT_FOUND`, and the writer puts those objects again the classic way.

Nothing here outlives the master process: a new leader or a restarted master knows no leases
(their writers get NOT_FOUND and put again), and the gaps are free space in the allocators it
rebuilds from the nodes' inventories, which list committed objects only.

The extent is allocated like any object (`tiering.TierPolicy.place`, under every tier's high
watermark), but only from free room: a generous extent is not worth evicting cached objects
for, so a lease that does not fit shrinks to `min_size` (the writer's next objects), which may
evict.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Sequence

from mooncake_k8s.common.errors import InvalidArgument, NoSpace
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.allocator import ALIGN, align_up
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.puts import check_put
from mooncake_k8s.store.master.quotas import TenantQuotas
from mooncake_k8s.store.master.records import Node, Obj, Rep, check_key, rep_pb
from mooncake_k8s.store.master.tiering import TierPolicy

log = logging.getLogger(__name__)

#: The largest extent one lease gets, and the share of the largest segment it may take: a
#: writer's lease should hold a few hundred blocks, not crowd out the cache.
MAX_EXTENT = 64 << 20
EXTENT_SHARE = 64
SPACE_TTL_S = 10.0
"""A lease lapses this long after it was granted or last committed to."""


class SpaceLease:
    """An extent leased to one writer: `reps` are where it starts in each replica's segment;
    `starts`/`ends` the sorted, aligned ranges committed from it (offsets in the extent)."""

    __slots__ = ("deadline", "ends", "lease_id", "reps", "size", "starts", "tenant")

    def __init__(self, lease_id: int, size: int, reps: list[Rep], deadline: float,
                 tenant: str = "") -> None:
        self.tenant = tenant
        self.lease_id = lease_id
        self.size = size
        self.reps = reps
        self.deadline = deadline
        self.starts: list[int] = []
        self.ends: list[int] = []

    def claim(self, offset: int, length: int) -> bool:
        """Record [offset, offset+length) as committed; False if it overlaps one that is.
        Writers commit mostly in carving order, so the common case is an append."""
        starts, ends = self.starts, self.ends
        if not starts or offset >= ends[-1]:
            starts.append(offset)
            ends.append(offset + length)
            return True
        i = bisect.bisect_right(starts, offset)
        if (i and ends[i - 1] > offset) or (i < len(starts) and starts[i] < offset + length):
            return False
        starts.insert(i, offset)
        ends.insert(i, offset + length)
        return True

    def gaps(self) -> list[tuple[int, int]]:
        """(offset, length) of every range never committed: what the lease's end frees."""
        out, pos = [], 0
        for s, e in zip(self.starts, self.ends, strict=True):
            if s > pos:
                out.append((pos, s - pos))
            pos = e
        if pos < self.size:
            out.append((pos, self.size - pos))
        return out


class SpaceLeases:
    """Space leases over the catalog's segments; a part of `state.MasterState` (its lock is
    held around every public method here, through `Catalog.op`)."""

    def __init__(self, catalog: Catalog, tiers: TierPolicy, quotas: TenantQuotas, *,
                 max_object_size: int, space_ttl_s: float) -> None:
        self._cat = catalog
        self._quotas = quotas
        self._tiers = tiers
        self.max_object_size = max_object_size
        self.space_ttl_s = space_ttl_s
        self._spaces: OrderedDict[int, SpaceLease] = OrderedDict()  # last-use order

    # -- grant ---------------------------------------------------------------------------------

    def lease_space(
        self, size: int, min_size: int = 0, replicas: int = 1, placement: int = pb.LOCAL_FIRST,
        preferred_segment: str = "", client_host_id: str = "", segments: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.SpaceLeaseResponse:
        """Lease an extent of up to `size` bytes (at least `min_size`) on `replicas` nodes, one
        of them on each of `segments` (see `TierPolicy.place`). The generous extent is taken
        only from free room, on the named segments themselves: one of them without room gets
        the `min_size` extent, made room for by eviction there, before it is replaced."""
        min_size = min_size or size
        if min_size > size:
            raise InvalidArgument(f"min_size {min_size} is above size {size}")
        replicas = check_put(min_size, replicas, placement, self.max_object_size, segments)
        with self._cat.op():
            self._quotas.admit(tenant, min_size, max(replicas, len(segments)))
            largest = max((s.alloc.capacity for s in self._cat.segments.values()), default=0)
            grant = max(min_size, min(size, MAX_EXTENT, largest // EXTENT_SHARE))
            try:
                reps = self._tiers.place(grant, replicas, placement, preferred_segment,
                                         client_host_id, evict=False, segments=segments,
                                         fallback=False)
            except NoSpace:
                grant = min_size
                reps = self._tiers.place(grant, replicas, placement, preferred_segment,
                                         client_host_id, segments=segments)
            grant = align_up(grant)
            lease = SpaceLease(self._cat.new_id(), grant, reps, self._cat.now() + self.space_ttl_s,
                               tenant)
            self._spaces[lease.lease_id] = lease
            return pb.SpaceLeaseResponse(
                lease_id=lease.lease_id, size=grant, replicas=[rep_pb(r) for r in reps],
                ttl_ms=int(self.space_ttl_s * 1000), align=ALIGN,
            )

    # -- commit --------------------------------------------------------------------------------

    def put_commit(
        self, lease_id: int, items: Sequence[pb.CommitItem], release: bool = False
    ) -> pb.PutCommitResponse:
        """Publish objects written into a leased extent; an error and a code per item."""
        errors: list[str] = []
        codes: list[int] = []
        with self._cat.op():
            lease = self._spaces.get(lease_id)
            if lease is None:
                msg = (f"space lease {lease_id} is unknown: released, expired, its node "
                       "restarted, or the master changed; put again")
                return pb.PutCommitResponse(errors=[msg] * len(items),
                                            codes=[pb.ERROR_NOT_FOUND] * len(items))
            lease.deadline = self._cat.now() + self.space_ttl_s
            self._spaces.move_to_end(lease_id)
            objects = self._cat.objects
            for it in items:
                err, code = self._commit_one(lease, objects, it)
                errors.append(err)
                codes.append(code)
            if release:
                self._end_space(lease)
        return pb.PutCommitResponse(errors=errors, codes=codes)  # type: ignore[arg-type]

    def _commit_one(
        self, lease: SpaceLease, objects: dict[str, Obj], it: pb.CommitItem
    ) -> tuple[str, int]:
        key, off, size = it.key, it.offset, it.size
        try:
            check_key(key)
        except InvalidArgument as e:
            return str(e), pb.ERROR_INVALID
        if size < 1 or size > self.max_object_size:
            return f"object {key!r}: size {size} is out of range", pb.ERROR_INVALID
        if off % ALIGN or off + size > lease.size:
            return (f"object {key!r}: range {off}+{size} is not an aligned part of the "
                    f"{lease.size}-byte extent"), pb.ERROR_INVALID
        if key in objects:
            return f"object {key!r} already exists", pb.ERROR_EXISTS
        if not lease.claim(off, align_up(size)):
            return (f"object {key!r}: range {off}+{size} overlaps an object committed from "
                    "this lease"), pb.ERROR_INVALID
        reps = [Rep(r.seg, r.offset + off) for r in lease.reps]
        for r in reps:
            r.seg.alloc.recount(1)
        self._cat.publish(key, size, it.checksum, reps)
        self._quotas.published(key, lease.tenant)
        return "", pb.ERROR_NONE

    # -- end -----------------------------------------------------------------------------------

    def space_release(self, lease_id: int) -> bool:
        """End a lease now (its unused space is freed); False if it is unknown."""
        with self._cat.op():
            lease = self._spaces.get(lease_id)
            if lease is None:
                return False
            self._end_space(lease)
            return True

    def _end_space(self, lease: SpaceLease) -> None:
        self._spaces.pop(lease.lease_id, None)
        gaps = lease.gaps()
        for rep in lease.reps:
            seg = rep.seg
            if not seg.alive:
                continue
            for off, length in gaps:
                seg.alloc.free(rep.offset + off, length, counted=False)
            seg.alloc.recount(-1)  # the extent itself

    def expire(self, now: float) -> None:
        """End leases not used for `space_ttl_s` (they are kept in last-use order)."""
        spaces = self._spaces
        while spaces:
            lease = next(iter(spaces.values()))
            if lease.deadline > now:
                break
            log.info("space lease expired", extra={"lease_id": lease.lease_id})
            self._end_space(lease)

    def cancel_on(self, node: Node) -> None:
        """End every lease with an extent on `node` (it died or restarted: what was written
        there is gone, so nothing more may be committed from those extents)."""
        for lease in [sl for sl in self._spaces.values()
                      if any(r.seg.node is node for r in sl.reps)]:
            log.info("space lease cancelled: its node restarted or left",
                     extra={"lease_id": lease.lease_id, "node_id": node.node_id})
            self._end_space(lease)

    @property
    def space_leases(self) -> int:
        return len(self._spaces)
