"""answers.py, the one mapping between the store's `ErrorCode` and exceptions: every code both
ways, and the batch put answers produced by a real MasterState and read as the client reads
them (through the wire bytes)."""

from __future__ import annotations

import pytest

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
from mooncake_k8s.store.client.errors import end_errors, start_error
from mooncake_k8s.store.master.state import MasterState, PutNotFound, PutSuperseded, UnknownNode
from mooncake_k8s.store.wire import code_error, code_of

KiB = 1 << 10

EXCEPTIONS: dict[int, type[Exception]] = {
    pb.ERROR_NONE: StoreError,
    pb.ERROR_EXISTS: ObjectExists,
    pb.ERROR_NOT_FOUND: ObjectNotFound,
    pb.ERROR_TOO_LARGE: ObjectTooLarge,
    pb.ERROR_NO_SPACE: NoSpace,
    pb.ERROR_INVALID: InvalidArgument,
    pb.ERROR_UNAVAILABLE: MasterUnavailable,
    pb.ERROR_INTERNAL: StoreError,
    pb.ERROR_QUOTA_EXCEEDED: QuotaExceeded,
}


def test_every_error_code_has_an_exception() -> None:
    assert set(EXCEPTIONS) == set(pb.ErrorCode.values())  # a new code needs a mapping


@pytest.mark.parametrize("code", sorted(set(pb.ErrorCode.values()) - {pb.ERROR_NONE}),
                         ids=pb.ErrorCode.Name)
def test_each_error_code_round_trips_through_its_exception(code: int) -> None:
    e = code_error(code, "why")
    assert type(e) is EXCEPTIONS[code] and str(e) == "why"
    assert code_of(e) == code


def test_no_code_reads_as_a_plain_store_error_and_answers_internal() -> None:
    e = code_error(pb.ERROR_NONE, "why")
    assert type(e) is StoreError and code_of(e) == pb.ERROR_INTERNAL


@pytest.mark.parametrize(("exc", "code"), [
    (PutSuperseded("another writer ended first"), pb.ERROR_EXISTS),
    (PutNotFound("put 7 is unknown"), pb.ERROR_NOT_FOUND),
    (UnknownNode("node a"), pb.ERROR_NOT_FOUND),
    (StoreError("other"), pb.ERROR_INTERNAL),
    (KeyError("a bug, not a miss"), pb.ERROR_INTERNAL),
    (RuntimeError("a bug"), pb.ERROR_INTERNAL),
])
def test_the_masters_own_errors_answer_their_code(exc: Exception, code: int) -> None:
    assert code_of(exc) == code


def _over_the_wire(msg: pb.BatchPutStartResponse | pb.BatchPutEndResponse) -> bytes:
    return bytes(msg.SerializeToString())


def test_batch_start_refusals_read_as_their_exceptions() -> None:
    st = MasterState()
    st.register_node("a", "127.0.0.1:7001", "h0", [
        pb.SegmentInfo(name="a-dram-0", tier=pb.DRAM, size=64 * KiB, path="/dev/shm/a-dram-0"),
    ], [])
    keys = ["x", "", "y", "z", "w"]
    sizes = [10, 10, 1 << 40, 60 * KiB, 60 * KiB]
    results = st.batch_put_start([pb.PutStartRequest(key=k, size=n)
                                  for k, n in zip(keys, sizes, strict=True)])
    wire = _over_the_wire(pb.BatchPutStartResponse(results=results))
    got = pb.BatchPutStartResponse.FromString(wire).results
    assert [r.code for r in got] == [
        pb.ERROR_NONE, pb.ERROR_INVALID, pb.ERROR_TOO_LARGE, pb.ERROR_NONE, pb.ERROR_NO_SPACE]
    read = [start_error(k, r.code, r.error) if r.error else None
            for k, r in zip(keys, got, strict=True)]
    assert [type(e) for e in read] == [type(None), InvalidArgument, ObjectTooLarge, type(None),
                                       NoSpace]
    assert str(read[4]).startswith("put 'w': ")


def test_batch_end_codes_read_as_exists_or_put_again() -> None:
    resp = pb.BatchPutEndResponse(
        errors=["", "superseded", "unknown put", "bad key"],
        codes=[pb.ERROR_NONE, pb.ERROR_EXISTS, pb.ERROR_NOT_FOUND, pb.ERROR_INVALID])
    read = end_errors(["a", "b", "c", "d"], pb.BatchPutEndResponse.FromString(
        _over_the_wire(resp)))
    assert read[0] is None
    assert type(read[1]) is ObjectExists and str(read[1]) == "put 'b': superseded"
    assert [type(e) for e in read[2:]] == [StoreError, StoreError]  # not a miss: put again
    assert str(read[2]) == "publishing 'c': unknown put"


def test_an_old_peers_string_codes_are_ignored_not_misread() -> None:
    # The numbers the string codes had (PutStartResult 3, BatchPutEndResponse 2) are reserved:
    # a peer that still sends them is read as untyped refusals, never as success or bogus codes.
    old_start = (pb.PutStartResult(error="no segment fits").SerializeToString()
                 + b"\x1a\x08NO_SPACE")
    r = pb.PutStartResult.FromString(old_start)
    assert r.code == pb.ERROR_NONE and r.error == "no segment fits"
    assert type(start_error("k", r.code, r.error)) is StoreError
    old_end = (pb.BatchPutEndResponse(errors=["", "gone"]).SerializeToString()
               + b"\x12\x00\x12\x09NOT_FOUND")
    resp = pb.BatchPutEndResponse.FromString(old_end)
    assert list(resp.codes) == []
    read = end_errors(["a", "b"], resp)
    assert read[0] is None and type(read[1]) is StoreError
