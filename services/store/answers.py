"""How the store client reads the master's answers: replica locations, and statuses and
per-item error codes turned into this project's exception types, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from mooncake_k8s.common.errors import (
    AuthError,
    InvalidArgument,
    MasterUnavailable,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.masterlink import ERROR_KEY, RECOVERING_KEY, trailers_of
from mooncake_k8s.transfer import Peer, SegmentDesc, Tier

_TIERS = {pb.DRAM: Tier.DRAM, pb.SSD: Tier.SSD}
SAFE_TO_RETRY = frozenset({"GetReplicas", "Exists", "Stats", "Pin", "ReleaseLease"})
"""Calls that change nothing a second attempt could trip over; others are retried only when
the master said it did nothing (the recovering trailer)."""


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


def location(r: pb.Replica) -> Location:
    return Location(
        Peer(r.node_id, r.address, r.host_id),
        SegmentDesc(r.segment, _TIERS.get(r.tier, Tier.DRAM), r.segment_size, r.segment_path),
        r.offset,
    )


def located(r: pb.Replica) -> tuple[Peer, SegmentDesc, int]:
    loc = location(r)
    return loc.peer, loc.segment, loc.offset


_BY_CODE: dict[int, type[StoreError] | type[InvalidArgument]] = {
    pb.ERROR_EXISTS: ObjectExists,
    pb.ERROR_NOT_FOUND: ObjectNotFound,
    pb.ERROR_TOO_LARGE: ObjectTooLarge,
    pb.ERROR_NO_SPACE: NoSpace,
    pb.ERROR_INVALID: InvalidArgument,
    pb.ERROR_UNAVAILABLE: MasterUnavailable,
}
"""The exception each `ErrorCode` stands for (anything else is a plain StoreError)."""
_BY_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: pb.ERROR_INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED: pb.ERROR_NO_SPACE,
    grpc.StatusCode.ALREADY_EXISTS: pb.ERROR_EXISTS,
    grpc.StatusCode.NOT_FOUND: pb.ERROR_NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: pb.ERROR_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: pb.ERROR_UNAVAILABLE,
}
"""For a status without the `mooncake-error` trailer (gRPC's own errors, a lost connection)."""
_NAMES = frozenset(pb.ErrorCode.keys())


def code_error(code: int, msg: str) -> StoreError | InvalidArgument:
    """The exception for an `ErrorCode`, with `msg`."""
    return _BY_CODE.get(code, StoreError)(msg)


def rpc_error(e: grpc.RpcError, what: str) -> StoreError | InvalidArgument | AuthError:
    """Turn a master status into this project's exception types, keeping the master's message:
    by the `ErrorCode` it named (`mooncake-error`), else by the status."""
    status = e.code()
    detail = e.details() or ""
    msg = f"{what}: {detail}" if detail else what
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(msg)
    named = trailers_of(e).get(ERROR_KEY, "")
    code = pb.ErrorCode.Value(named) if named in _NAMES else _BY_STATUS.get(
        status, pb.ERROR_INTERNAL)
    return code_error(code, msg)


def default_replicas() -> int:
    """MOONCAKE_STORE_REPLICAS, or 1; InvalidArgument names the variable when it is bad."""
    raw = os.environ.get("MOONCAKE_STORE_REPLICAS", "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise InvalidArgument(f"MOONCAKE_STORE_REPLICAS must be an integer 1..8, not {raw!r}")
    return int(raw)


def retryable(e: grpc.RpcError, method: str) -> bool:
    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return False
    if method in SAFE_TO_RETRY:
        return True
    return RECOVERING_KEY in trailers_of(e)


def end_error(key: str, code: str, message: str) -> StoreError:
    if code == "EXISTS":
        return ObjectExists(f"put {key!r}: {message}")
    return StoreError(f"publishing {key!r}: {message}")


def start_error(key: str, code: str, message: str) -> StoreError | InvalidArgument:
    text = f"put {key!r}: {message}"
    if code == "NO_SPACE":
        return NoSpace(text)
    if code == "TOO_LARGE":
        return ObjectTooLarge(text)
    if code == "INVALID":
        return InvalidArgument(text)
    return StoreError(text)
