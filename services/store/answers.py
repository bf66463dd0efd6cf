"""The store's errors on the wire, both ways, in one place: the `ErrorCode` (store.proto) an
exception stands for (`code_of`, used by the master for its per-item answers) and the exception
a code stands for (`code_error`, used by the client for statuses, trailers and per-item codes);
and how the client reads the rest of the master's answers (replica locations)."""

from __future__ import annotations

import os
from collections.abc import Sequence
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
_CODE_OF: tuple[tuple[type[Exception], pb.ErrorCode], ...] = (
    (ObjectTooLarge, pb.ERROR_TOO_LARGE),  # first: it is an InvalidArgument too
    (InvalidArgument, pb.ERROR_INVALID),
    (NoSpace, pb.ERROR_NO_SPACE),
    (ObjectExists, pb.ERROR_EXISTS),  # the master's PutSuperseded among them
    (MasterUnavailable, pb.ERROR_UNAVAILABLE),
)
"""The `ErrorCode` of an exception, first match wins (the inverse of `_BY_CODE`); a store
error that is also a LookupError is ERROR_NOT_FOUND (see `code_of`)."""
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


def start_error(key: str, code: int, message: str) -> StoreError | InvalidArgument:
    """The exception for one refused item of a BatchPutStart (`PutStartResult.code`)."""
    return code_error(code, f"put {key!r}: {message}")


def end_errors(keys: Sequence[str], resp: pb.BatchPutEndResponse) -> list[StoreError | None]:
    """Per item of a BatchPutEnd for `keys`: None when it was published, else ObjectExists
    (another put of the key ended first: it is stored) or a StoreError (put again). A master
    that sends no codes (another version) has every failed item read as the latter."""
    codes = list(resp.codes) or [pb.ERROR_NONE] * len(resp.errors)
    return [
        _end_error(key, code, msg) if msg else None
        for key, msg, code in zip(keys, resp.errors, codes, strict=False)
    ]


def _end_error(key: str, code: int, message: str) -> StoreError:
    if code == pb.ERROR_EXISTS:
        return ObjectExists(f"put {key!r}: {message}")
    return StoreError(f"publishing {key!r}: {message}")
