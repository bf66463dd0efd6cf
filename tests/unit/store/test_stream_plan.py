"""The lease plan's wire form (`store.client.plan`): what `StreamPut.plan()` hands a pipeline
stage round-trips exactly, and a plan that cannot be right is refused with a message naming
what is wrong (a stage must never write where the leader did not lease)."""

from __future__ import annotations

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.plan import (
    MAGIC,
    VERSION,
    PlanObject,
    PlanReplica,
    decode_plan,
    encode_plan,
)
from mooncake_k8s.transfer import Peer, SegmentDesc, Tier


def replica(node: str, offset: int, tier: Tier = Tier.DRAM) -> PlanReplica:
    return PlanReplica(Peer(node, f"127.0.0.1:{4000 + len(node)}", f"host-{node}"),
                       SegmentDesc(f"{node}-dram-0", tier, 1 << 20, f"/dev/shm/{node}"),
                       offset)


def wire(*objects: pb.PlanObject) -> bytes:
    return MAGIC + bytes([VERSION]) + pb.StreamPlan(objects=list(objects)).SerializeToString()


def test_a_plan_round_trips() -> None:
    objects = [PlanObject(49216, (replica("na", 0), replica("nb", 4096, Tier.SSD))),
               PlanObject(17, (replica("nb", 53312),))]
    assert decode_plan(encode_plan(objects)) == objects
    assert decode_plan(memoryview(encode_plan(objects))) == objects


@pytest.mark.parametrize(("data", "why"), [
    (b"MCP", "not a stream plan"),
    (b"MCKV\x01", "not a stream plan"),
    (MAGIC + b"\x00", "version 0 is not supported"),
    (MAGIC + bytes([VERSION]) + b"\x0a\x05\x08", "corrupt"),
    (wire(), "names no objects"),
    (wire(pb.PlanObject(size=0, replicas=[pb.Replica(address="a:1", segment="s")])),
     "object 0 has no bytes"),
    (wire(pb.PlanObject(size=5)), "object 0 has no replicas"),
    (wire(pb.PlanObject(size=5, replicas=[pb.Replica(segment="s")])),
     "without an address"),
    (wire(pb.PlanObject(size=5, replicas=[pb.Replica(address="a:1", segment="s", offset=0)]),
          pb.PlanObject(size=64, replicas=[pb.Replica(address="a:1", segment="s",
                                                      offset=4000, segment_size=4033)])),
     r"object 1 ends past segment 's' \(4000 \+ 64 > 4033\)"),
    (wire(pb.PlanObject(size=5, replicas=[pb.Replica(address="a:1", segment="../x")])),
     "segment"),
])
def test_bad_plans_are_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        decode_plan(data)


def test_a_plan_is_bytes() -> None:
    with pytest.raises(InvalidArgument, match="not str"):
        decode_plan("MCPL")  # type: ignore[arg-type]
