"""What the master's refusals mean to the client: the exception a failed call raises (by the
`ErrorCode` its `mooncake-error` trailer names, else by the gRPC status), the exception for one
refused item of a batch, and whether a failed call may be sent again. The codes themselves, both
ways, are in `store.wire`."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from mooncake_k8s.common.errors import (
    AuthError,
    InvalidArgument,
    ObjectExists,
    StoreError,
)
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.masterlink import trailers_of
from mooncake_k8s.store.wire import ERROR_KEY, ERROR_NAMES, RECOVERING_KEY, code_error

SAFE_TO_RETRY = frozenset({"GetReplicas", "Exists", "Stats", "Pin", "ReleaseLease"})
"""Calls that change nothing a second attempt could trip over; others are retried only when
the master said it did nothing (the recovering trailer)."""
_BY_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: pb.ERROR_INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED: pb.ERROR_NO_SPACE,
    grpc.StatusCode.ALREADY_EXISTS: pb.ERROR_EXISTS,
    grpc.StatusCode.NOT_FOUND: pb.ERROR_NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: pb.ERROR_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: pb.ERROR_UNAVAILABLE,
}
"""For a status without the `mooncake-error` trailer (gRPC's own errors, a lost connection)."""


def rpc_error(e: grpc.RpcError, what: str) -> StoreError | InvalidArgument | AuthError:
    """Turn a master status into this project's exception types, keeping the master's message:
    by the `ErrorCode` it named (`mooncake-error`), else by the status."""
    status = e.code()
    detail = e.details() or ""
    msg = f"{what}: {detail}" if detail else what
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(msg)
    named = trailers_of(e).get(ERROR_KEY, "")
    code = pb.ErrorCode.Value(named) if named in ERROR_NAMES else _BY_STATUS.get(
        status, pb.ERROR_INTERNAL)
    return code_error(code, msg)


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
