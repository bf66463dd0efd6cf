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
from mooncake_k8s.store.masterlink import RECOVERING_KEY, trailers_of
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


def rpc_error(e: grpc.RpcError, what: str) -> StoreError | InvalidArgument | AuthError:
    """Turn a master status into this project's exception types, keeping the master's message."""
    code = e.code()
    detail = e.details() or ""
    msg = f"{what}: {detail}" if detail else what
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ObjectTooLarge(msg) if "too large" in detail.lower() else InvalidArgument(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoSpace(msg)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(msg)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return ObjectExists(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return ObjectNotFound(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return MasterUnavailable(msg)
    return StoreError(msg)


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
