"""The master's records: nodes, segments, objects, puts, leases, copies, and their wire forms.

Plain data with `__slots__` (the per-object footprint is what bounds how many keys one master
holds) and the pure encoders that turn a record into protobuf bytes. No locks, no I/O: only
`metadata.MasterState` creates and mutates these, under its one lock.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.allocator import SegmentAllocator

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
    __slots__ = ("alive", "alloc", "lru", "name", "node", "path", "size", "spilling", "tier")

    def __init__(self, node: Node, info: pb.SegmentInfo) -> None:
        self.node = node
        self.name: str = info.name
        self.tier: int = info.tier
        self.size: int = info.size
        self.path: str = info.path
        self.alloc = SegmentAllocator(info.size)
        self.lru: OrderedDict[str, Obj] = OrderedDict()  # committed objects here, LRU first
        self.spilling = 0  # bytes of replicas being copied away (freed when the copy is done)
        self.alive = True

    def fill(self) -> float:
        return self.alloc.used / self.alloc.capacity if self.alloc.capacity else 1.0


class Rep:
    __slots__ = ("offset", "seg")

    def __init__(self, seg: Segment, offset: int) -> None:
        self.seg = seg
        self.offset = offset


class Obj:
    __slots__ = ("checksum", "copying", "hidden", "key", "leases", "mixed_hosts", "pinned",
                 "reps", "size", "ssd_only", "wire")

    def __init__(self, key: str, size: int, checksum: int, reps: list[Rep]) -> None:
        self.key = key
        self.size = size
        self.checksum = checksum
        self.reps = reps
        self.pinned = False
        self.leases = 0
        self.hidden = False
        self.copying = False
        self.ssd_only = False
        self.mixed_hosts = False
        self.wire: bytes | None = None  # cached encoded GetReplicasResponse.objects entry


class Pending:
    __slots__ = ("claim_until", "deadline", "key", "put_id", "reps", "size")

    def __init__(
        self, put_id: int, key: str, size: int, reps: list[Rep], deadline: float,
        claim_until: float,
    ) -> None:
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
        self.kind = kind  # "spill" | "promote"
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


def encode_obj(obj: Obj, host_id: str = "") -> bytes:
    reps = sorted(
        obj.reps,
        key=lambda r: (bool(host_id) and r.seg.node.host_id != host_id, r.seg.tier != DRAM),
    )
    body = pb.ObjectReplicas(
        found=True, size=obj.size, checksum=obj.checksum, replicas=[rep_pb(r) for r in reps]
    ).SerializeToString()
    return b"\x0a" + varint(len(body)) + body


