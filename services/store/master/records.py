"""The master's records: nodes, segments, objects, puts, leases, copies, and their wire forms.

Plain data with `__slots__` and the pure encoders that turn a record into protobuf bytes. No
locks, no I/O: only `state.MasterState` and its parts create and mutate these, under its one lock.

The per-object footprint is what bounds how many keys one master holds, so an object is one
small record (`Obj`) with no list, dict, set or cache of its own: its replica is inline, the
part of its lookup answer that names the segment is shared by the whole segment
(`Segment.head`), and its offset, size and checksum live only in its pre-encoded answer tail.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.allocator import SegmentAllocator

DRAM: int = pb.DRAM
SSD: int = pb.SSD
MAX_KEY_BYTES = 512

_CTRL = re.compile(r"[\x00-\x1f\x7f]")
MISS = b"\x0a\x00"  # GetReplicasResponse.objects entry for ObjectReplicas(found=False)


# -- records (slots keep the per-object footprint small) ------------------------------------


class Node:
    __slots__ = ("address", "alive", "commands", "host_id", "incarnation", "last_seen", "node_id",
                 "segments", "stream", "waker")

    def __init__(
        self, node_id: str, address: str, host_id: str, now: float, incarnation: str = ""
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation  # the node process's random id; "" from old nodes
        self.address = address
        self.host_id = host_id
        self.last_seen = now
        self.segments: list[Segment] = []
        self.commands: deque[pb.NodeCommand] = deque()
        self.stream = 0
        self.waker: Callable[[], None] | None = None  # see MasterState.open_command_stream
        self.alive = True


class Segment:
    """A node's segment as the master sees it, with what its objects' lookups share.

    `head` is the part of a lookup answer (a `GetReplicasResponse.objects` entry) that every
    single-replica object of this segment shares: everything but the replica's offset and the
    object's size and checksum, which each object keeps in its `tail` (`Obj`). Those three are
    written as varints padded to a fixed width (`w` bytes for offset and size, 10 for the
    checksum; the protobuf wire format allows non-minimal varints and any field order), so
    every tail of the segment has one length and one shared head fits them all.

    `queue` orders the segment's objects for eviction (see `evict_order`); it may hold stale
    entries (objects gone from here), which scans skip and `enqueue` compacts away.
    """

    __slots__ = ("alive", "alloc", "count", "head", "name", "node", "path", "queue", "size",
                 "spilling", "tier", "w")

    def __init__(self, node: Node, info: pb.SegmentInfo) -> None:
        self.node = node
        self.name: str = info.name
        self.tier: int = info.tier
        self.size: int = info.size
        self.path: str = info.path
        self.alloc = SegmentAllocator(info.size, track=False)  # objects know their sizes
        self.queue: deque[Obj] = deque()  # committed objects here, least recently used first
        self.count = 0  # replicas here (the queue's live entries)
        self.spilling = 0  # bytes of replicas being copied away (freed when the copy is done)
        self.alive = True
        self.w = len(varint(max(info.size, 1)))  # any offset or object size here fits w bytes
        self.head = b""
        self.refresh()

    def fill(self) -> float:
        return self.alloc.used / self.alloc.capacity if self.alloc.capacity else 1.0

    def refresh(self) -> None:
        """(Re)build `head` from the node's current address and host."""
        node = self.node
        fixed = pb.Replica(
            node_id=node.node_id, address=node.address, host_id=node.host_id, segment=self.name,
            tier=self.tier,  # type: ignore[arg-type]
        ).SerializeToString() + pb.Replica(
            segment_path=self.path, segment_size=self.size,
        ).SerializeToString()
        rep_len = len(fixed) + 1 + self.w  # + the offset field
        body_len = 1 + len(varint(rep_len)) + rep_len + (TAIL_FIXED + self.w)
        self.head = b"\x0a" + varint(body_len) + b"\x22" + varint(rep_len) + fixed + b"\x30"

    def tail(self, offset: int, size: int, checksum: int) -> bytes:
        """An object's own part of its lookup answer: offset, found, size, checksum."""
        w = self.w
        return (padded(offset, w) + b"\x08\x01\x10" + padded(size, w) + b"\x18"
                + padded(checksum, 10))

    def enqueue(self, obj: Obj) -> None:
        """`obj` now has a replica here: it is the most recently used one."""
        self.queue.append(obj)
        self.count += 1
        if len(self.queue) > 2 * self.count + 64:
            self.queue = deque(self.live())

    def live(self) -> list[Obj]:
        """The objects with a replica here, least recently used first (each once)."""
        seen: set[int] = set()
        out = []
        for obj in self.queue:
            if obj.on(self) and id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
        return out


class Rep:
    """One replica of an object that has several (or of a put in progress)."""

    __slots__ = ("offset", "ref", "seg")

    def __init__(self, seg: Segment, offset: int, ref: bool = False) -> None:
        self.seg = seg
        self.offset = offset
        self.ref = ref  # looked up since its segment's eviction scan last passed it

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rep) and other.seg is self.seg and other.offset == self.offset

    def __hash__(self) -> int:
        return hash((id(self.seg), self.offset))


# Obj.state: flags in the low bits, the number of read leases above them.
PINNED = 1
HIDDEN = 2  # removed while leased: invisible, freed when the last lease ends
COPYING = 4  # a spill or promotion copy of it is running
SLOW = 8  # lookups take the general path: several replicas (or none), or SSD only
REF = 16  # looked up since its segment's eviction scan last passed it (single replica)
LEASE = 32  # one read lease
TAIL_FIXED = 14  # bytes of a single-replica tail besides offset and size: tags, found, checksum


class Obj:
    """A committed object in as few bytes as Python allows (the master's memory is its size
    times the number of objects; see `state.BYTES_PER_OBJECT`).

    One replica (the common case): `at` is its Segment and `tail` its own part of the lookup
    answer (`Segment.tail`), so a lookup is `at.head + tail` and offset, size and checksum are
    read back from the tail when needed. Otherwise `at` is the list of replicas and `tail` the
    whole encoded answer (DRAM replicas first). The key is the `_objects` dict's own string.
    """

    __slots__ = ("at", "key", "state", "tail")

    def __init__(self, key: str, size: int, checksum: int, reps: list[Rep]) -> None:
        self.key = key
        self.state = 0
        self.at: Segment | list[Rep] = []
        self.tail = b""
        self.set_reps(reps, size, checksum)

    # -- replicas ----------------------------------------------------------------------------

    @property
    def reps(self) -> list[Rep]:
        """The replicas, as a new list (change them with `set_reps`)."""
        at = self.at
        if isinstance(at, Segment):
            return [Rep(at, varint_at(self.tail, 0), bool(self.state & REF))]
        return list(at)

    def set_reps(self, reps: list[Rep], size: int = -1, checksum: int = -1) -> None:
        if size < 0:
            size, checksum = self.size, self.checksum
        state = self.state & ~(SLOW | REF)
        if len(reps) == 1:
            rep = reps[0]
            seg = self.at = rep.seg
            self.tail = seg.tail(rep.offset, size, checksum)
            self.state = state | (REF if rep.ref else 0) | (SLOW if seg.tier != DRAM else 0)
        else:
            if isinstance(self.at, Segment) and self.state & REF:
                for r in reps:
                    r.ref = r.ref or r.seg is self.at
            self.at = list(reps)
            self.tail = encode_entry(self.at, size, checksum)
            self.state = state | SLOW

    def on(self, seg: Segment) -> bool:
        """Whether a visible replica of this object is on `seg`."""
        at = self.at
        if self.state & HIDDEN:
            return False
        return at is seg if isinstance(at, Segment) else any(r.seg is seg for r in at)

    def rep_on(self, seg: Segment) -> Rep:
        return next(r for r in self.reps if r.seg is seg)

    def take_ref(self, seg: Segment) -> bool:
        """Whether it was looked up since the last call for `seg`; clears that mark."""
        at = self.at
        if isinstance(at, Segment):
            ref = bool(self.state & REF)
            self.state &= ~REF
            return ref
        for r in at:
            if r.seg is seg:
                ref, r.ref = r.ref, False
                return ref
        return False

    @property
    def ssd_only(self) -> bool:
        at = self.at
        if isinstance(at, Segment):
            return at.tier != DRAM
        return bool(at) and all(r.seg.tier != DRAM for r in at)

    # -- fields kept in the tail -------------------------------------------------------------

    @property
    def size(self) -> int:
        at = self.at
        if isinstance(at, Segment):
            return varint_at(self.tail, at.w + 3)
        return entry_fields(self.tail)[0]

    @property
    def checksum(self) -> int:
        at = self.at
        if isinstance(at, Segment):
            return varint_at(self.tail, 2 * at.w + 4)
        return entry_fields(self.tail)[1]

    # -- flags -------------------------------------------------------------------------------

    @property
    def leases(self) -> int:
        return self.state // LEASE

    def _flag(self, bit: int, on: bool) -> None:
        self.state = self.state | bit if on else self.state & ~bit

    @property
    def pinned(self) -> bool:
        return bool(self.state & PINNED)

    @pinned.setter
    def pinned(self, on: bool) -> None:
        self._flag(PINNED, on)

    @property
    def hidden(self) -> bool:
        return bool(self.state & HIDDEN)

    @hidden.setter
    def hidden(self, on: bool) -> None:
        self._flag(HIDDEN, on)

    @property
    def copying(self) -> bool:
        return bool(self.state & COPYING)

    @copying.setter
    def copying(self, on: bool) -> None:
        self._flag(COPYING, on)


class Pending:
    __slots__ = ("claim_until", "deadline", "key", "put_id", "reps", "size", "tenant")

    def __init__(
        self, put_id: int, key: str, size: int, reps: list[Rep], deadline: float,
        claim_until: float, tenant: str = "",
    ) -> None:
        self.tenant = tenant  # whose quota the object counts against (quotas.py)
        self.put_id = put_id
        self.key = key
        self.size = size
        self.reps = reps
        self.deadline = deadline  # the space is reclaimed then unless the put ended
        self.claim_until = claim_until  # until then no other writer may start this key


class Lease:
    __slots__ = ("expires", "lease_id", "objs")

    def __init__(self, lease_id: int, expires: float, objs: list[Obj]) -> None:
        self.lease_id = lease_id
        self.expires = expires
        self.objs = objs


class Copy:
    __slots__ = ("cmd_id", "deadline", "dst", "kind", "node", "obj", "src")

    def __init__(
        self, cmd_id: int, kind: str, obj: Obj, src: Rep, dst: Rep, deadline: float
    ) -> None:
        self.cmd_id = cmd_id
        self.kind = kind  # "spill" | "promote" | "fanout"
        self.obj = obj
        self.src = src
        self.dst = dst
        self.node = src.seg.node
        self.deadline = deadline


@dataclass(slots=True)
class Lookup:
    """The answer to `get_replicas`, kept pre-encoded: `entries` are wire-format
    `GetReplicasResponse.objects` fields, one per key, in request order."""

    entries: list[bytes]
    lease_id: int
    lease_expires_unix_ms: int
    found: int

    def encode(self) -> bytes:
        """The serialized GetReplicasResponse."""
        tail = b""
        if self.lease_id:
            tail += b"\x10" + varint(self.lease_id)
        if self.lease_expires_unix_ms:
            tail += b"\x18" + varint(self.lease_expires_unix_ms)
        return b"".join(self.entries) + tail

    def response(self) -> pb.GetReplicasResponse:
        return pb.GetReplicasResponse.FromString(self.encode())


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def check_key(key: str) -> None:
    if not key:
        raise InvalidArgument("key is empty")
    if len(key) > MAX_KEY_BYTES or len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"key is longer than {MAX_KEY_BYTES} bytes")
    if _CTRL.search(key):
        raise InvalidArgument("key contains control characters")


def rep_pb(r: Rep) -> pb.Replica:
    seg = r.seg
    node = seg.node
    return pb.Replica(
        node_id=node.node_id, address=node.address, host_id=node.host_id, segment=seg.name,
        tier=seg.tier, offset=r.offset, segment_path=seg.path, segment_size=seg.size,  # type: ignore[arg-type]
    )


def encode_entry(reps: list[Rep], size: int, checksum: int, host_id: str = "") -> bytes:
    """The canonical `GetReplicasResponse.objects` entry of an object: DRAM replicas first,
    and with `host_id` that host's replicas before all others."""
    ordered = sorted(
        reps, key=lambda r: (bool(host_id) and r.seg.node.host_id != host_id, r.seg.tier != DRAM)
    )
    body = pb.ObjectReplicas(
        found=True, size=size, checksum=checksum, replicas=[rep_pb(r) for r in ordered]
    ).SerializeToString()
    return b"\x0a" + varint(len(body)) + body


def encode_obj(obj: Obj, host_id: str = "") -> bytes:
    """`obj`'s lookup answer for a client on `host_id`."""
    at = obj.at
    if isinstance(at, Segment) and not host_id:
        return at.head + obj.tail
    return encode_entry(obj.reps, obj.size, obj.checksum, host_id)


def padded(n: int, width: int) -> bytes:
    """`n` as a varint of exactly `width` bytes (continuation bits on zero-valued bytes)."""
    if n < 0 or n >> (7 * width):
        raise ValueError(f"{n} does not fit a {width}-byte varint")
    out = bytearray(width)
    for i in range(width - 1):
        out[i] = (n & 0x7F) | 0x80
        n >>= 7
    out[width - 1] = n
    return bytes(out)


def varint_at(buf: bytes, pos: int) -> int:
    """The varint that starts at `buf[pos]`."""
    n = shift = 0
    while True:
        b = buf[pos]
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n
        pos += 1
        shift += 7


def entry_fields(entry: bytes) -> tuple[int, int]:
    """(size, checksum) of a canonical `encode_entry` answer."""
    pos = 1
    while entry[pos] >= 0x80:  # the entry's length
        pos += 1
    pos += 1
    size = checksum = 0
    while pos < len(entry) and entry[pos] in (0x08, 0x10, 0x18):
        tag = entry[pos]
        value = varint_at(entry, pos + 1)
        pos += 1
        while entry[pos] >= 0x80:
            pos += 1
        pos += 1
        if tag == 0x10:
            size = value
        elif tag == 0x18:
            checksum = value
    return size, checksum
