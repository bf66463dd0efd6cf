"""The lease plan of a streamed put: where each object's bytes go, as bytes another process reads.

A block whose layers are computed on different hosts (the stages of a pipeline group) is
written by several processes into the space one of them (the leader) leased: the leader's
`StreamPut.plan()` encodes, per object, its size and every replica's peer, segment and the
absolute offset of the object's first byte; each stage's `PlanWriter` decodes it and writes
its byte ranges there. The leader alone commits, so nothing here grants anything: a plan only
says where leased (not yet visible) space is, and the storage nodes still check every write
against the cluster token and the segment's bounds.

Wire form: b"MCPL", one version byte, then a `StreamPlan` message (store.proto). Anything
else, a version this build does not read, or a plan that cannot be right (an empty object, an
object without replicas, a replica without an address, an object past its segment's end) is
refused with InvalidArgument naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.wire import Location, location
from mooncake_k8s.transfer.segments import Tier

MAGIC = b"MCPL"
VERSION = 1
_TIER_PB = {Tier.DRAM: pb.DRAM, Tier.SSD: pb.SSD}


PlanReplica = Location
"""One replica of one plan object: its bytes go to `segment` of `peer` from `offset` on (the
store's `Location` of a replica, as reads use it)."""


@dataclass(frozen=True)
class PlanObject:
    size: int
    replicas: tuple[PlanReplica, ...]


def encode_plan(objects: Sequence[PlanObject]) -> bytes:
    """The plan's wire form (module docstring)."""
    msg = pb.StreamPlan(objects=[
        pb.PlanObject(size=o.size, replicas=[
            pb.Replica(node_id=r.peer.node_id, address=r.peer.address, host_id=r.peer.host_id,
                       segment=r.segment.name, tier=_TIER_PB.get(r.segment.tier, pb.DRAM),
                       offset=r.offset, segment_path=r.segment.path,
                       segment_size=r.segment.size)
            for r in o.replicas])
        for o in objects])
    return MAGIC + bytes([VERSION]) + msg.SerializeToString()


def decode_plan(data: bytes | bytearray | memoryview) -> list[PlanObject]:
    """The objects of an encoded plan; InvalidArgument says why `data` is not one."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"a stream plan is bytes, not {type(data).__name__}")
    raw = bytes(data)
    if raw[:4] != MAGIC or len(raw) < 5:
        raise InvalidArgument("not a stream plan (it does not start with b'MCPL' + version)")
    if raw[4] != VERSION:
        raise InvalidArgument(
            f"stream plan version {raw[4]} is not supported (this build reads {VERSION})")
    try:
        msg = pb.StreamPlan.FromString(raw[5:])
    except DecodeError as e:
        raise InvalidArgument(f"stream plan is corrupt: {e}") from e
    objects = [_object(i, o) for i, o in enumerate(msg.objects)]
    if not objects:
        raise InvalidArgument("stream plan names no objects")
    return objects


def _object(i: int, o: pb.PlanObject) -> PlanObject:
    if o.size < 1:
        raise InvalidArgument(f"stream plan object {i} has no bytes")
    if not o.replicas:
        raise InvalidArgument(f"stream plan object {i} has no replicas")
    reps = []
    for r in o.replicas:
        if not r.address or not r.segment:
            raise InvalidArgument(
                f"stream plan object {i} names a replica without an address or segment")
        if r.segment_size and r.offset + o.size > r.segment_size:
            raise InvalidArgument(
                f"stream plan object {i} ends past segment {r.segment!r} "
                f"({r.offset} + {o.size} > {r.segment_size})")
        reps.append(location(r))
    return PlanObject(o.size, tuple(reps))
