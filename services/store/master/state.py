"""The store master's whole logic as plain Python: nodes, objects, puts, leases, eviction.

`MasterState` holds no sockets and no threads. The gRPC shell (`master.py`) calls it from many
threads, so every public method takes the one state lock; tests drive it directly with a fake
clock. Messages that cross the wire (replica descriptions, node commands, block events) are
built here as protobuf messages because that is what they are; nothing here imports grpc.

Puts are `puts.ClassicPuts` (two phases, `put_start` / `put_end`) and `spaces.SpaceLeases`
(one round trip, from a leased extent), both mixins of this class.

A node that registers again with a new incarnation (a restarted process) is reconciled with
the inventory it reports: replicas the master recorded there that the node no longer lists are
dropped at once, and puts or copies aimed at its old process are cancelled.

A committed object has one or more replicas (segment, offset) on distinct nodes. A lookup
(`get_replicas`) grants a read lease; while any lease covers an object it is neither evicted nor
freed. `remove` hides an object at once; a leased one keeps its space until the last lease ends.

Node registration, restarts, loss and command streams are `membership.NodeMembership`, and
placement, eviction, spilling to SSD and promotion back to DRAM are `tiering.TierPolicy`, both
mixins of this class; no allocation takes any segment of any tier above its high watermark.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from mooncake_k8s.common import defaults
from mooncake_k8s.common.errors import (
    InvalidArgument,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.events import EventHub, Subscription
from mooncake_k8s.store.master.membership import NodeMembership
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
from mooncake_k8s.store.master.records import (
    HIDDEN,
    LEASE,
    MISS,
    REF,
    SLOW,
    Copy,
    Lease,
    Lookup,
    Node,
    Obj,
    Pending,
    Rep,
    Segment,
    encode_entry,
)
from mooncake_k8s.store.master.spaces import SPACE_TTL_S, SpaceLease, SpaceLeases
from mooncake_k8s.store.master.tiering import TierPolicy

log = logging.getLogger(__name__)

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
_CMD = pb.NodeCommand


class UnknownNode(StoreError, LookupError):
    """The node is not registered with this master (it restarted, or the node timed out)."""


class MasterState(ClassicPuts, NodeMembership, TierPolicy, SpaceLeases):
    """Everything the master knows; see the module docstring. Thread-safe."""

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
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        master_id: str | None = None,
        first_id: int | None = None,
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
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.put_timeout_s = put_timeout_s
        self.put_claim_s = put_claim_s
        self.space_ttl_s = space_ttl_s
        self.lease_ms = lease_ms
        self.max_lease_ms = max_lease_ms
        self.node_timeout_s = node_timeout_s
        self.max_object_size = max_object_size
        self._now = now
        self._wall = wall
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._nodes: dict[str, Node] = {}
        self._segments: dict[str, Segment] = {}
        self._objects: dict[str, Obj] = {}
        self._pending: OrderedDict[int, Pending] = OrderedDict()  # deadline order
        self._pending_keys: dict[str, int] = {}
        self._spaces: OrderedDict[int, SpaceLease] = OrderedDict()  # last-use order
        self._leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._copies: dict[int, Copy] = {}
        # Put, lease and command ids share one sequence. It starts at a random point so that a
        # put id issued by a previous master process is never mistaken for one of ours.
        if first_id is None:
            first_id = (secrets.randbits(31) << 20) + 1
        self._ids = itertools.count(first_id)
        self._seq = 0
        self._hub = EventHub(event_queue)
        self._outbox: list[pb.BlockEvent] = []
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.spills = 0
        self.promotions = 0
        self.hidden_objects = 0

    # -- plumbing --------------------------------------------------------------------------

    def _new_id(self) -> int:
        return next(self._ids)

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        with self._lock:
            try:
                yield
            finally:
                if self._outbox:
                    self._hub.publish(self._outbox)
                    self._outbox = []

    def _emit(self, kind: int, key: str, size: int, seg: Segment) -> None:
        self._seq += 1
        if self._hub.active:
            self._outbox.append(
                _EV(
                    seq=self._seq, kind=kind, key=key, node_id=seg.node.node_id,  # type: ignore[arg-type]
                    segment=seg.name, tier=seg.tier, size=size,  # type: ignore[arg-type]
                    unix_ms=int(self._wall() * 1000),
                )
            )

    def _command(self, node: Node, kind: int, key: str, seg: Segment, offset: int, size: int,
                 checksum: int = 0, src: Rep | None = None) -> int:
        cmd_id = next(self._ids)
        if node.alive:
            node.commands.append(
                _CMD(
                    id=cmd_id, kind=kind, key=key, segment=seg.name, offset=offset, size=size,  # type: ignore[arg-type]
                    checksum=checksum, src_segment=src.seg.name if src else "",
                    src_offset=src.offset if src else 0,
                )
            )
            self._wake(node)
        return cmd_id

    def _free_rep(self, obj: Obj, rep: Rep, committed: bool = True) -> None:
        seg = rep.seg
        if seg.alive:
            size = obj.size
            seg.alloc.free(rep.offset, size)
            if committed:
                self._command(seg.node, _CMD.FREED, obj.key, seg, rep.offset, size)

    def _drop_rep(self, obj: Obj, rep: Rep, kind: int) -> None:
        """Take one replica away from a visible object (evicted, node gone, spilled away)."""
        reps = obj.reps
        reps.remove(rep)
        self._free_rep(obj, rep)
        obj.set_reps(reps)
        seg = rep.seg
        seg.count -= 1  # its queue entry is stale now; scans skip it
        if kind:
            self._emit(kind, obj.key, obj.size, seg)
        if not reps and self._objects.get(obj.key) is obj:
            del self._objects[obj.key]

    def _release_hidden(self, obj: Obj) -> None:
        for rep in obj.reps:
            self._free_rep(obj, rep)
        obj.set_reps([])
        self.hidden_objects -= 1

    # -- reads -----------------------------------------------------------------------------

    def get_replicas(
        self, keys: Sequence[str], lease_ms: int = 0, client_host_id: str = ""
    ) -> Lookup:
        """Replicas of each key (DRAM first; same-host first when `client_host_id` is given)
        and one read lease over every found key."""
        lease_ms = min(lease_ms or self.lease_ms, self.max_lease_ms)
        entries: list[bytes] = []
        add = entries.append
        with self._op():
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
            found = len(leased)
            self.hits += found
            self.misses += len(entries) - found
            if not leased:
                return Lookup(entries, 0, 0, 0)
            lease_id = next(self._ids)
            expires = self._now() + lease_ms / 1000.0
            self._leases[lease_id] = Lease(lease_id, expires, leased)
            heapq.heappush(self._lease_heap, (expires, lease_id))
            return Lookup(entries, lease_id, int(self._wall() * 1000) + lease_ms, found)

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
            if client_host_id and len({r.seg.node.host_id for r in at}) > 1:
                wire = encode_entry(at, obj.size, obj.checksum, client_host_id)
        if obj.ssd_only and not obj.copying:
            self._promote(obj)
        return wire

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early; False if it is unknown (already released or expired)."""
        with self._op():
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._end_lease(lease)
            return True

    def _end_lease(self, lease: Lease) -> None:
        for obj in lease.objs:
            obj.state -= LEASE
            if obj.state < LEASE and obj.state & HIDDEN and obj.at:
                self._release_hidden(obj)

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
        with self._op():
            for key in keys:
                obj = self._objects.pop(key, None)
                if obj is None:
                    out.append(False)
                    continue
                size = obj.size
                for rep in obj.reps:
                    rep.seg.count -= 1  # its queue entry is stale now; scans skip it
                    self._emit(_EV.REMOVED, key, size, rep.seg)
                obj.hidden = True
                self.hidden_objects += 1
                if force or obj.leases == 0:
                    self._release_hidden(obj)
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
        with self._op():
            now = self._now()
            for node in list(self._nodes.values()):
                if now - node.last_seen > self.node_timeout_s:
                    self._drop_node(node, f"no heartbeat for {self.node_timeout_s}s")
            while self._pending:
                put = next(iter(self._pending.values()))
                if put.deadline > now:
                    break
                log.info("put timed out", extra={"key": put.key, "put_id": put.put_id})
                self._end_pending(put)
            self._expire_spaces(now)
            heap = self._lease_heap
            while heap and heap[0][0] <= now:
                _, lease_id = heapq.heappop(heap)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._end_lease(lease)
            for cp in [c for c in self._copies.values() if c.deadline <= now]:
                del self._copies[cp.cmd_id]
                self._finish_copy(cp, False, "timed out")
            for seg in list(self._segments.values()):
                if seg.alloc.used > self.high_watermark * seg.alloc.capacity:
                    self._shrink(seg)

    # -- events, stats, shutdown ----------------------------------------------------------

    def subscribe(self, node_id: str = "", max_queue: int | None = None) -> Subscription:
        """Block events from now on (only `node_id`'s when given), in a bounded queue."""
        return self._hub.subscribe(node_id, max_queue)

    @property
    def event_seq(self) -> int:
        return self._seq

    def stats(self) -> pb.StatsResponse:
        with self._lock:
            segs = [
                pb.SegmentStats(
                    name=s.name, node_id=s.node.node_id, tier=s.tier, size=s.size,  # type: ignore[arg-type]
                    used=s.alloc.used, objects=s.count,
                )
                for s in self._segments.values()
            ]
            replicas = sum(s.count for s in self._segments.values())
            n = len(self._objects)
            return pb.StatsResponse(
                master_id=self.master_id, objects=n, pending_puts=len(self._pending),
                nodes=len(self._nodes), segments=segs, evictions=self.evictions,
                spills=self.spills, promotions=self.promotions,
                meta_bytes_estimate=self.meta_bytes_estimate(n, replicas),
            )

    @staticmethod
    def meta_bytes_estimate(objects: int, replicas: int) -> int:
        return objects * BYTES_PER_OBJECT + max(0, replicas - objects) * BYTES_PER_EXTRA_REPLICA

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "spills": self.spills, "promotions": self.promotions,
                "objects": len(self._objects), "nodes": len(self._nodes),
                "pending_puts": len(self._pending), "leases": len(self._leases),
                "space_leases": len(self._spaces),
            }

    def segment_usage(self) -> list[tuple[str, int, int, int]]:
        """(name, tier, size, used) of every live segment."""
        with self._lock:
            return [(s.name, s.tier, s.alloc.capacity, s.alloc.used)
                    for s in self._segments.values()]

    def node_ids(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    def close(self) -> None:
        """End every command stream and subscription (shutdown)."""
        with self._lock:
            self._closed = True
            for node in self._nodes.values():
                self._wake(node)
        self._hub.close()
