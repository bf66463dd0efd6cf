"""The store master's whole logic as plain Python: nodes, objects, puts, leases, eviction.

`MasterState` holds no sockets and no threads. The gRPC shell (`server.py`) calls it from many
threads, so every public method takes the one state lock; tests drive it directly with a fake
clock. Messages that cross the wire (replica descriptions, node commands, block events) are
built here as protobuf messages because that is what they are; nothing here imports grpc.

The state is one class made of parts, each given what it works with at construction rather
than sharing this class's privates: `catalog.Catalog` holds the shared records (nodes, segments,
objects, ids, events, counters) and the primitives that change them; `tiering.TierPolicy`
(placement, eviction, spilling, promotion and their copies), `puts.ClassicPuts` (two phases,
`put_start` / `put_end`), `spaces.SpaceLeases` (one round trip, from a leased extent),
`replicas.ReplicaAdds` (a replica added to a stored object) and `membership.NodeMembership`
(registration, restarts, loss, command streams) own their records and call each other through
public methods. This class keeps reads, read leases, removal and
pins, and runs the parts' periodic work (`tick`).

A node that registers again with a new incarnation (a restarted process) is reconciled with
the inventory it reports: replicas the master recorded there that the node no longer lists are
dropped at once, and puts or copies aimed at its old process are cancelled.

A committed object has one or more replicas (segment, offset) on distinct nodes. A lookup
(`get_replicas`) grants a read lease; while any lease covers an object it is neither evicted nor
freed. `remove` hides an object at once; a leased one keeps its space until the last lease ends.

No allocation takes any segment of any tier above its high watermark (`tiering`).
"""

from __future__ import annotations

import heapq
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from mooncake_k8s.common import defaults
from mooncake_k8s.common.errors import (
    InvalidArgument,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.events import Subscription
from mooncake_k8s.store.master.fanout import Fanout, FanoutSettings, spread
from mooncake_k8s.store.master.membership import NodeMembership, Registration
from mooncake_k8s.store.master.puts import (
    MAX_REPLICAS as MAX_REPLICAS,
)
from mooncake_k8s.store.master.puts import (
    ClassicPuts,
)
from mooncake_k8s.store.master.puts import (
    PutNotFound as PutNotFound,  # re-exported: callers catch them as the master's errors
)
from mooncake_k8s.store.master.puts import (
    PutSuperseded as PutSuperseded,
)
from mooncake_k8s.store.master.quotas import Quota, TenantQuotas, TenantUsage
from mooncake_k8s.store.master.records import (
    HIDDEN,
    LEASE,
    MISS,
    REF,
    SLOW,
    Lease,
    Lookup,
    Obj,
    Segment,
    encode_entry,
)
from mooncake_k8s.store.master.replicas import ReplicaAdds
from mooncake_k8s.store.master.spaces import SPACE_TTL_S, SpaceLeases
from mooncake_k8s.store.master.tiering import TierPolicy

MAX_LEASE_MS = 60_000
#: Master RSS per committed single-replica object with a 32-char key, lookups included:
#: 265 B at 1,000,000 objects (bench/master_mem_bench.py; 828 B before the records were
#: compacted). The key string is ~96 of it, the `_objects` dict slot 42-84 (it doubles in
#: steps), the `Obj` 64, its answer tail 64, its eviction queue slot 8.
BYTES_PER_OBJECT = 270
#: An object with several replicas keeps a list of them and its whole encoded answer: a
#: second replica adds ~390 B, a third ~185 (tracemalloc, 10k objects).
BYTES_PER_EXTRA_REPLICA = 400

_EV = pb.BlockEvent


class UnknownNode(StoreError, LookupError):
    """The node is not registered with this master (it restarted, or the node timed out)."""


class MasterState:
    """Everything the master knows, made of its parts; see the module docstring. Thread-safe."""

    def __init__(
        self,
        *,
        high_watermark: float = defaults.HIGH_WATERMARK,
        low_watermark: float = defaults.LOW_WATERMARK,
        put_timeout_s: float = defaults.PUT_TIMEOUT_S,
        put_claim_s: float = 1.0,
        space_ttl_s: float = SPACE_TTL_S,
        lease_ms: int = defaults.LEASE_MS,
        max_lease_ms: int = MAX_LEASE_MS,
        node_timeout_s: float = defaults.NODE_TIMEOUT_S,
        max_object_size: int = 1 << 30,
        event_queue: int = 10_000,
        fanout: FanoutSettings | None = None,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        master_id: str | None = None,
        first_id: int | None = None,
        tenant_quotas: Mapping[str, Quota] | None = None,
    ) -> None:
        if not 0.0 < high_watermark <= 1.0:
            raise InvalidArgument(f"high_watermark must be in (0, 1], got {high_watermark}")
        if not 0.0 <= low_watermark < high_watermark:
            raise InvalidArgument("low_watermark must be >= 0 and below high_watermark")
        if lease_ms < 1 or max_lease_ms < lease_ms:
            raise InvalidArgument("lease_ms must be >= 1 and <= max_lease_ms")
        if put_claim_s <= 0:
            raise InvalidArgument(f"put_claim_s must be > 0, got {put_claim_s}")
        self.master_id = master_id or uuid.uuid4().hex
        self.lease_ms = lease_ms
        self.max_lease_ms = max_lease_ms
        # Put, lease and command ids share one sequence. It starts at a random point so that a
        # put id issued by a previous master process is never mistaken for one of ours.
        if first_id is None:
            first_id = (secrets.randbits(31) << 20) + 1
        cat = self.catalog = Catalog(now=now, wall=wall, first_id=first_id,
                                     event_queue=event_queue)
        self.quotas = TenantQuotas(cat, tenant_quotas)
        self.tiers = TierPolicy(cat, high_watermark=high_watermark, low_watermark=low_watermark,
                                copy_timeout_s=put_timeout_s)
        self.puts = ClassicPuts(cat, self.tiers, self.quotas, max_object_size=max_object_size,
                                put_timeout_s=put_timeout_s, put_claim_s=put_claim_s)
        self.spaces = SpaceLeases(cat, self.tiers, self.quotas, max_object_size=max_object_size,
                                  space_ttl_s=space_ttl_s)
        self.adds = ReplicaAdds(cat, self.tiers, timeout_s=put_timeout_s)
        self.fanout = Fanout(fanout or FanoutSettings(), cat)
        self._fan = self.fanout if self.fanout.enabled else None
        self.tiers.fanout = self._fan
        self.membership = NodeMembership(cat, self.tiers, self.puts, self.spaces, self.adds,
                                         master_id=self.master_id, node_timeout_s=node_timeout_s)
        self._lock = cat.lock
        self._objects = cat.objects
        self._segments = cat.segments
        self._leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []

    # -- the parts' calls, as the servicer makes them ---------------------------------------

    def register_node(
        self, node_id: str, address: str, host_id: str, segments: Sequence[pb.SegmentInfo],
        inventory: Sequence[pb.InventoryItem] = (), incarnation: str = "",
        journal: Sequence[pb.InventoryItem] = (),
    ) -> Registration:
        """See `membership.NodeMembership.register_node`."""
        return self.membership.register_node(node_id, address, host_id, segments, inventory,
                                             incarnation, journal)

    def heartbeat(self, node_id: str) -> bool:
        return self.membership.heartbeat(node_id)

    def open_command_stream(
        self, node_id: str, master_id: str = "", waker: Callable[[], None] | None = None
    ) -> int | None:
        return self.membership.open_command_stream(node_id, master_id, waker)

    def next_commands(
        self, node_id: str, stream: int, timeout: float
    ) -> list[pb.NodeCommand] | None:
        return self.membership.next_commands(node_id, stream, timeout)

    def command_done(self, node_id: str, cmd_id: int, ok: bool, error: str = "") -> bool:
        return self.membership.command_done(node_id, cmd_id, ok, error)

    def put_start(
        self, key: str, size: int, replicas: int = 1, placement: int = pb.LOCAL_FIRST,
        preferred_segment: str = "", client_host_id: str = "", segments: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.PutStartResponse:
        """See `puts.ClassicPuts.put_start`."""
        return self.puts.put_start(key, size, replicas, placement, preferred_segment,
                                   client_host_id, segments, tenant=tenant)

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        self.puts.put_end(key, put_id, checksum)

    def put_revoke(self, key: str, put_id: int) -> None:
        self.puts.put_revoke(key, put_id)

    def batch_put_start(self, items: Sequence[pb.PutStartRequest]) -> list[pb.PutStartResult]:
        return self.puts.batch_put_start(items)

    def batch_put_end(self, items: Sequence[pb.PutEndRequest]) -> pb.BatchPutEndResponse:
        return self.puts.batch_put_end(items)

    def lease_space(
        self, size: int, min_size: int = 0, replicas: int = 1, placement: int = pb.LOCAL_FIRST,
        preferred_segment: str = "", client_host_id: str = "", segments: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.SpaceLeaseResponse:
        """See `spaces.SpaceLeases.lease_space`."""
        return self.spaces.lease_space(size, min_size, replicas, placement, preferred_segment,
                                       client_host_id, segments, tenant=tenant)

    def put_commit(
        self, lease_id: int, items: Sequence[pb.CommitItem], release: bool = False
    ) -> pb.PutCommitResponse:
        return self.spaces.put_commit(lease_id, items, release)

    def space_release(self, lease_id: int) -> bool:
        return self.spaces.space_release(lease_id)

    @property
    def space_leases(self) -> int:
        return self.spaces.space_leases

    def replica_start(self, keys: Sequence[str], segment: str) -> list[pb.ReplicaStartResult]:
        """See `replicas.ReplicaAdds.replica_start`."""
        return self.adds.replica_start(keys, segment)

    def replica_end(
        self, items: Sequence[pb.ReplicaEndItem]
    ) -> tuple[pb.ReplicaEndResponse, list[tuple[str, str]]]:
        """See `replicas.ReplicaAdds.replica_end`."""
        return self.adds.replica_end(items)

    # -- reads -----------------------------------------------------------------------------

    def get_replicas(
        self, keys: Sequence[str], lease_ms: int = 0, client_host_id: str = ""
    ) -> Lookup:
        """Replicas of each key (DRAM first; same-host first when `client_host_id` is given)
        and one read lease over every found key."""
        lease_ms = min(lease_ms or self.lease_ms, self.max_lease_ms)
        entries: list[bytes] = []
        add = entries.append
        cat = self.catalog
        fan = self._fan if client_host_id else None
        with cat.op():
            get = self._objects.get
            leased: list[Obj] = []
            hold = leased.append
            for key in keys:
                obj = get(key)
                if obj is None:
                    add(MISS)
                    continue
                state = obj.state
                if state & SLOW:
                    add(self._lookup_slow(obj, client_host_id))
                    state = obj.state
                else:  # one replica, in DRAM: its segment's shared head and its own tail
                    add(obj.at.head + obj.tail)  # type: ignore[union-attr]
                obj.state = (state | REF) + LEASE  # looked up (for eviction), leased
                hold(obj)
                if fan is not None:  # counts reads by host; may start a fan-out copy
                    fan.note_read(obj, client_host_id, self.tiers)
            found = len(leased)
            if self.quotas.owners:  # a tenant's objects read now are its warmest
                self.quotas.touch(leased)
            cat.hits += found
            cat.misses += len(entries) - found
            if not leased:
                return Lookup(entries, 0, 0, 0)
            lease_id = cat.new_id()
            expires = cat.now() + lease_ms / 1000.0
            self._leases[lease_id] = Lease(lease_id, expires, leased)
            heapq.heappush(self._lease_heap, (expires, lease_id))
            return Lookup(entries, lease_id, int(cat.wall() * 1000) + lease_ms, found)

    def _lookup_slow(self, obj: Obj, client_host_id: str) -> bytes:
        """The answer for an object with several replicas (or one, on SSD only): marks each
        replica looked up, orders them for the client's host, queues a promotion to DRAM."""
        at = obj.at
        if isinstance(at, Segment):
            wire = at.head + obj.tail
        else:
            for r in at:
                r.ref = True
            wire = obj.tail
            fan = self._fan
            if (fan is not None and client_host_id
                    and all(r.seg.node.host_id != client_host_id for r in at)):
                # no replica on the reader's host: readers take turns over the replicas
                wire = encode_entry(spread(at, fan.turn()), obj.size, obj.checksum)
            elif client_host_id and len({r.seg.node.host_id for r in at}) > 1:
                wire = encode_entry(at, obj.size, obj.checksum, client_host_id)
        if obj.ssd_only and not obj.copying:
            self.tiers.promote(obj)
        return wire

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early; False if it is unknown (already released or expired)."""
        with self.catalog.op():
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._end_lease(lease)
            return True

    def _end_lease(self, lease: Lease) -> None:
        for obj in lease.objs:
            obj.state -= LEASE
            if obj.state < LEASE and obj.state & HIDDEN and obj.at:
                self.catalog.release_hidden(obj)

    def exists(self, keys: Sequence[str]) -> tuple[list[bool], int]:
        """Presence of each key and how many leading keys are all present."""
        with self._lock:
            objects = self._objects
            present = [k in objects for k in keys]
        try:
            prefix = present.index(False)
        except ValueError:
            prefix = len(present)
        return present, prefix

    # -- removal, pinning ------------------------------------------------------------------

    def replica_records(self, keys: Sequence[str]) -> list[tuple[str, str, pb.InventoryItem]]:
        """(node id, node incarnation, item) for every replica of the committed `keys`: what
        an HA leader journals before acknowledging a put (see `ha`)."""
        out = []
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.hidden:
                    continue
                for rep in obj.reps:
                    node = rep.seg.node
                    out.append((node.node_id, node.incarnation, pb.InventoryItem(
                        key=key, segment=rep.seg.name, offset=rep.offset, size=obj.size,
                        checksum=obj.checksum)))
        return out

    def remove(self, keys: Sequence[str], force: bool = False) -> list[bool]:
        """Remove objects; a leased one (unless `force`) is hidden now and freed after its
        last lease. False for unknown keys."""
        out = []
        cat = self.catalog
        with cat.op():
            for key in keys:
                obj = self._objects.pop(key, None)
                if obj is None:
                    out.append(False)
                    continue
                size = obj.size
                for rep in obj.reps:
                    rep.seg.count -= 1  # its queue entry is stale now; scans skip it
                    cat.emit(_EV.REMOVED, key, size, rep.seg)
                obj.hidden = True
                cat.hidden_objects += 1
                if force or obj.leases == 0:
                    self.catalog.release_hidden(obj)
                out.append(True)
        return out

    def pin(self, keys: Sequence[str], pin: bool = True) -> list[bool]:
        """Soft-pin (or unpin) objects: evicted only when nothing else frees enough."""
        out = []
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None:
                    obj.pinned = pin
                out.append(obj is not None)
        return out

    # -- periodic work ---------------------------------------------------------------------

    def tick(self) -> None:
        """Expire nodes, puts, leases and copies; evict segments above the high watermark."""
        with self.catalog.op():
            now = self.catalog.now()
            self.membership.expire(now)
            self.puts.expire(now)
            self.spaces.expire(now)
            self.adds.expire(now)
            self.quotas.trim()
            heap = self._lease_heap
            while heap and heap[0][0] <= now:
                _, lease_id = heapq.heappop(heap)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._end_lease(lease)
            self.tiers.expire_copies(now)
            high = self.tiers.high_watermark
            for seg in list(self._segments.values()):
                if seg.alloc.used > high * seg.alloc.capacity:
                    self.tiers.shrink(seg)

    # -- events, stats, shutdown ----------------------------------------------------------

    def subscribe(self, node_id: str = "", max_queue: int | None = None) -> Subscription:
        """Block events from now on (only `node_id`'s when given), in a bounded queue."""
        return self.catalog.hub.subscribe(node_id, max_queue)

    def subscribe_snapshot(
        self, node_id: str = "", max_queue: int | None = None,
    ) -> tuple[list[tuple[str, str, str, int, int]], int, Subscription]:
        """What is stored now, and the block events from then on, with nothing between them
        missed or repeated: the replicas are listed and the subscription made under the state
        lock, and every event is published under it too (`Catalog.op`). Returns
        ((key, node id, segment, tier, size) per replica of each visible object, the sequence
        number of the last event the list already reflects, the subscription). The list holds
        plain tuples: the caller builds the messages outside the lock."""
        segment_cls = Segment
        with self._lock:
            out: list[tuple[str, str, str, int, int]] = []
            add = out.append
            for key, obj in self._objects.items():
                at = obj.at
                segs = (at,) if isinstance(at, segment_cls) else [r.seg for r in at]
                size = obj.size
                for seg in segs:
                    nid = seg.node.node_id
                    if not node_id or nid == node_id:
                        add((key, nid, seg.name, int(seg.tier), size))
            sub = self.catalog.hub.subscribe(node_id, max_queue)
            return out, self.catalog.seq, sub

    @property
    def event_seq(self) -> int:
        return self.catalog.seq

    # -- counters (the catalog's, which the parts update) ------------------------------------

    @property
    def hits(self) -> int:
        return self.catalog.hits

    @property
    def misses(self) -> int:
        return self.catalog.misses

    @property
    def evictions(self) -> int:
        return self.catalog.evictions

    @property
    def spills(self) -> int:
        return self.catalog.spills

    @property
    def promotions(self) -> int:
        return self.catalog.promotions

    @property
    def hidden_objects(self) -> int:
        return self.catalog.hidden_objects

    def stats(self) -> pb.StatsResponse:
        with self._lock:
            segs = [
                pb.SegmentStats(
                    name=s.name, node_id=s.node.node_id, tier=s.tier, size=s.size,  # type: ignore[arg-type]
                    used=s.alloc.used, objects=s.count, host_id=s.node.host_id,
                )
                for s in self._segments.values()
            ]
            replicas = sum(s.count for s in self._segments.values())
            n = len(self._objects)
            return pb.StatsResponse(
                master_id=self.master_id, objects=n, pending_puts=len(self.puts.pending),
                nodes=len(self.catalog.nodes), segments=segs, evictions=self.evictions,
                spills=self.spills, promotions=self.promotions,
                meta_bytes_estimate=self.meta_bytes_estimate(n, replicas),
                tenants=[row.to_pb() for row in self.quotas.report()],
            )

    @staticmethod
    def meta_bytes_estimate(objects: int, replicas: int) -> int:
        return objects * BYTES_PER_OBJECT + max(0, replicas - objects) * BYTES_PER_EXTRA_REPLICA

    def tenant_report(self) -> list[TenantUsage]:
        """Per-tenant usage, quota and counters (`quotas.TenantQuotas.report`)."""
        with self._lock:
            return self.quotas.report()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "spills": self.spills, "promotions": self.promotions,
                "objects": len(self._objects), "nodes": len(self.catalog.nodes),
                "pending_puts": len(self.puts.pending), "leases": len(self._leases),
                "space_leases": self.spaces.space_leases,
                "fanout_added": self.fanout.added, "fanout_dropped": self.fanout.dropped,
                "fanout_hot": self.fanout.hot_objects,
                "fanout_extra": self.fanout.extra_replicas,
            }

    def segment_usage(self) -> list[tuple[str, int, int, int]]:
        """(name, tier, size, used) of every live segment."""
        with self._lock:
            return [(s.name, s.tier, s.alloc.capacity, s.alloc.used)
                    for s in self._segments.values()]

    def node_ids(self) -> list[str]:
        with self._lock:
            return list(self.catalog.nodes)

    def close(self) -> None:
        """End every command stream and subscription (shutdown)."""
        cat = self.catalog
        with cat.lock:
            cat.closed = True
            for node in cat.nodes.values():
                cat.wake(node)
        cat.hub.close()
