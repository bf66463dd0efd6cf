"""What the store's master and its callers (clients, storage nodes) agree on over the wire.

Both sides import this module and nothing of each other: the trailer names an answer carries,
the `ErrorCode` (store.proto) an exception stands for and the exception a code stands for, how
a `Replica` message reads as a location the transfer engine can use, and the framing of the
master's fast path (`master.fastpath` serves it, `client.fastpath` calls it).

It holds no sockets and imports neither gRPC nor anything that does (of the transfer layer only
its plain types), so the master's state can use it and stay pure.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from mooncake_k8s.common.errors import (
    InvalidArgument,
    MasterUnavailable,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    QuotaExceeded,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.transfer.ops import Peer
from mooncake_k8s.transfer.segments import SegmentDesc, Tier

# -- trailers ---------------------------------------------------------------------------------

EPOCH_KEY = "mooncake-epoch"
"""The answering leader's fencing token (HA): answers below the highest seen are dropped."""
STANDBY_KEY = "mooncake-standby"
"""On an UNAVAILABLE from a standby master: the call did nothing, retry at the leader."""
LEADER_KEY = "mooncake-leader"
"""With STANDBY_KEY, the leader's address when the standby knows it."""
RECOVERING_KEY = "mooncake-recovering"
"""On an UNAVAILABLE the master sent on purpose while it rebuilds: the call did nothing, so
even a put may be retried."""
FAST_PORT_KEY = "mooncake-fast-port"
"""On gRPC answers: the master's fast-path port."""
ERROR_KEY = "mooncake-error"
"""Names the `ErrorCode` of a refused call (store.proto)."""

# -- error codes, both ways ---------------------------------------------------------------

_BY_CODE: dict[int, type[StoreError] | type[InvalidArgument]] = {
    pb.ERROR_EXISTS: ObjectExists,
    pb.ERROR_NOT_FOUND: ObjectNotFound,
    pb.ERROR_TOO_LARGE: ObjectTooLarge,
    pb.ERROR_NO_SPACE: NoSpace,
    pb.ERROR_QUOTA_EXCEEDED: QuotaExceeded,
    pb.ERROR_INVALID: InvalidArgument,
    pb.ERROR_UNAVAILABLE: MasterUnavailable,
}
"""The exception each `ErrorCode` stands for (anything else is a plain StoreError)."""
_CODE_OF: tuple[tuple[type[Exception], pb.ErrorCode], ...] = (
    (ObjectTooLarge, pb.ERROR_TOO_LARGE),  # first: it is an InvalidArgument too
    (InvalidArgument, pb.ERROR_INVALID),
    (QuotaExceeded, pb.ERROR_QUOTA_EXCEEDED),  # before NoSpace: it is one
    (NoSpace, pb.ERROR_NO_SPACE),
    (ObjectExists, pb.ERROR_EXISTS),  # the master's PutSuperseded among them
    (MasterUnavailable, pb.ERROR_UNAVAILABLE),
)
"""The `ErrorCode` of an exception, first match wins (the inverse of `_BY_CODE`); a store
error that is also a LookupError is ERROR_NOT_FOUND (see `code_of`)."""
ERROR_NAMES = frozenset(pb.ErrorCode.keys())


def code_error(code: int, msg: str) -> StoreError | InvalidArgument:
    """The exception for an `ErrorCode`, with `msg`."""
    return _BY_CODE.get(code, StoreError)(msg)


def code_of(e: Exception) -> pb.ErrorCode:
    """The `ErrorCode` that names `e` on the wire: `code_error(code_of(e), msg)` is an
    exception of the class `e` is read as. A store error that is also a LookupError
    (ObjectNotFound, the master's PutNotFound and UnknownNode) is ERROR_NOT_FOUND; anything
    unmapped is ERROR_INTERNAL."""
    for cls, code in _CODE_OF:
        if isinstance(e, cls):
            return code
    if isinstance(e, StoreError) and isinstance(e, LookupError):
        return pb.ERROR_NOT_FOUND
    return pb.ERROR_INTERNAL


# -- replicas -------------------------------------------------------------------------------

_TIERS = {pb.DRAM: Tier.DRAM, pb.SSD: Tier.SSD}


@dataclass(frozen=True)
class Location:
    """Where one replica's bytes are: enough for the transfer engine to read them."""

    peer: Peer
    segment: SegmentDesc
    offset: int


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    checksum: int
    replicas: tuple[Location, ...]


@dataclass(frozen=True)
class SegmentInfo:
    """A segment as `StoreClient.segments` lists it: `host_id` is its node's host (segments
    of one host are local to each other), `tier` "dram" or "ssd", `size` and `used` bytes."""

    name: str
    node_id: str
    host_id: str
    tier: str
    size: int
    used: int


def location(r: pb.Replica) -> Location:
    return Location(
        Peer(r.node_id, r.address, r.host_id),
        SegmentDesc(r.segment, _TIERS.get(r.tier, Tier.DRAM), r.segment_size, r.segment_path),
        r.offset,
    )


def located(r: pb.Replica) -> tuple[Peer, SegmentDesc, int]:
    loc = location(r)
    return loc.peer, loc.segment, loc.offset


# -- fast-path frames (see master.fastpath for the protocol) ------------------------------------

MAGIC = b"MCFP"
VERSION = 1
#: Calls the fast path carries, by method number (the order is the wire protocol).
METHODS: tuple[tuple[str, Any, Any], ...] = (
    ("PutStart", pb.PutStartRequest, pb.PutStartResponse),
    ("PutEnd", pb.PutEndRequest, pb.PutEndResponse),
    ("PutRevoke", pb.PutRevokeRequest, pb.PutRevokeResponse),
    ("BatchPutStart", pb.BatchPutStartRequest, pb.BatchPutStartResponse),
    ("BatchPutEnd", pb.BatchPutEndRequest, pb.BatchPutEndResponse),
    ("GetReplicas", pb.GetReplicasRequest, pb.GetReplicasResponse),
    ("ReleaseLease", pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse),
    ("Exists", pb.ExistsRequest, pb.ExistsResponse),
    ("Remove", pb.RemoveRequest, pb.RemoveResponse),
    ("Pin", pb.PinRequest, pb.PinResponse),
    ("Stats", pb.StatsRequest, pb.StatsResponse),
    ("SpaceLease", pb.SpaceLeaseRequest, pb.SpaceLeaseResponse),
    ("PutCommit", pb.PutCommitRequest, pb.PutCommitResponse),
    ("SpaceRelease", pb.SpaceReleaseRequest, pb.SpaceReleaseResponse),
)
METHOD_IDS = {name: i for i, (name, _, _) in enumerate(METHODS)}
HDR = struct.Struct("<IB")
"""A frame's header: body length, then the method (request) or status (answer)."""
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")


def pack_trailers(trailers: tuple[tuple[str, str], ...]) -> bytes:
    out = [U16.pack(len(trailers))]
    for k, v in trailers:
        for part in (k.encode(), v.encode()):
            out += [U16.pack(len(part)), part]
    return b"".join(out)


def unpack_trailers(data: bytes | memoryview, pos: int) -> tuple[tuple[str, str], ...]:
    (n,) = U16.unpack_from(data, pos)
    pos += 2
    out = []
    for _ in range(n):
        parts = []
        for _ in range(2):
            (ln,) = U16.unpack_from(data, pos)
            parts.append(bytes(data[pos + 2: pos + 2 + ln]).decode())
            pos += 2 + ln
        out.append((parts[0], parts[1]))
    return tuple(out)


def short_message(msg: str) -> bytes:
    """A u16-length-prefixed message (the hello's answer)."""
    m = msg.encode()
    return U16.pack(len(m)) + m
