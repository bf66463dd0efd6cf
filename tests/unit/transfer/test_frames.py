"""The transfer wire format: round trips, and a decoder that only ever raises ProtocolError."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_k8s.common.errors import ProtocolError
from mooncake_k8s.transfer import frames as fr

names = st.from_regex(r"[A-Za-z0-9._-]{1,100}", fullmatch=True)


@given(names, st.integers(0, 2**32 - 1), st.integers(0, fr.MAX_OFFSET),
       st.binary(max_size=300))
def test_request_round_trip(name: str, rid: int, offset: int, payload: bytes) -> None:
    raw = name.encode()
    read = fr.encode_request(fr.OP_READ, raw, rid, offset, 12345)
    req, used = fr.decode_request(read + b"trailing")
    assert used == len(read)
    assert (req.op, req.name, req.req_id, req.offset, req.length) == (
        fr.OP_READ, name, rid, offset, 12345)
    write = fr.encode_request(fr.OP_WRITE, raw, rid, offset, len(payload)) + payload
    req, used = fr.decode_request(write)
    assert used == len(write) and req.payload == payload and req.op == fr.OP_WRITE


@given(st.integers(0, 2**32 - 1), st.binary(max_size=200), st.text(max_size=100))
def test_response_round_trip(rid: int, payload: bytes, message: str) -> None:
    ok = fr.encode_response(fr.ST_OK, rid, len(payload)) + payload
    resp, used = fr.decode_response(ok, fr.OP_READ)
    assert (resp.status, resp.req_id, resp.payload, used) == (fr.ST_OK, rid, payload, len(ok))
    resp, used = fr.decode_response(fr.encode_response(fr.ST_OK, rid, 77), fr.OP_WRITE)
    assert (resp.length, used) == (77, fr.RESPONSE.size)
    err = fr.encode_error(fr.ST_OUT_OF_RANGE, rid, message)
    resp, used = fr.decode_response(err, fr.OP_WRITE)
    assert resp.status == fr.ST_OUT_OF_RANGE and resp.message == message and used == len(err)


@given(st.text(max_size=200))
def test_hello_round_trip(token: str) -> None:
    raw = fr.encode_hello(token)
    version, tok, used = fr.decode_hello(raw)
    assert (version, tok, used) == (fr.VERSION, token.encode(), len(raw))
    status, msg, used = fr.decode_hello_reply(fr.encode_hello_reply(fr.HELLO_AUTH_FAILED, "no"))
    assert (status, msg) == (fr.HELLO_AUTH_FAILED, "no")


def test_specific_errors() -> None:
    good = fr.encode_request(fr.OP_READ, b"seg", 1, 0, 10)
    cases = {
        b"XX" + good[2:]: "bad request magic",
        good[:2] + b"\x07" + good[3:]: "unknown op code 7",
        fr.REQUEST.pack(b"MQ", 1, 0, 1, 0, 1): "name length 0",
        fr.REQUEST.pack(b"MQ", 1, 101, 1, 0, 1) + b"a" * 101: "name length 101",
        fr.REQUEST.pack(b"MQ", 1, 3, 1, 0, fr.MAX_OP_BYTES + 1) + b"seg": "over limit",
        fr.REQUEST.pack(b"MQ", 1, 3, 1, fr.MAX_OFFSET + 1, 1) + b"seg": "offset",
        fr.REQUEST.pack(b"MQ", 1, 3, 1, 0, 1) + b"s/g": "invalid segment name",
        good[:10]: "truncated request header",
        good[:-1]: "truncated segment name",
        fr.encode_request(fr.OP_WRITE, b"seg", 1, 0, 10) + b"12345": "truncated WRITE payload",
    }
    for raw, msg in cases.items():
        with pytest.raises(ProtocolError, match=msg):
            fr.decode_request(raw)
    with pytest.raises(ProtocolError, match="unknown response status"):
        fr.decode_response(fr.RESPONSE.pack(b"MR", 200, 1, 0))
    with pytest.raises(ProtocolError, match="error message length"):
        fr.decode_response(fr.RESPONSE.pack(b"MR", fr.ST_INTERNAL, 1, fr.MAX_MESSAGE + 1))
    with pytest.raises(ProtocolError, match="hello token length"):
        fr.decode_hello(fr.HELLO.pack(fr.MAGIC, 1, fr.MAX_TOKEN + 1))
    with pytest.raises(ProtocolError, match="bad hello magic"):
        fr.decode_hello(b"HTTP/1.1 200")


def _decoders(data: bytes) -> None:
    for fn in (
        fr.decode_request,
        lambda d: fr.decode_response(d, fr.OP_READ),
        lambda d: fr.decode_response(d, fr.OP_WRITE),
        fr.decode_hello,
        fr.decode_hello_reply,
        fr.decode_request_header,
        fr.decode_response_header,
        fr.decode_name,
    ):
        with contextlib.suppress(ProtocolError):
            fn(data)


@settings(max_examples=500)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decoders(data)


@settings(max_examples=300)
@given(st.sampled_from(["REQ_R", "REQ_W", "RESP", "ERR", "HELLO", "REPLY"]),
       st.data())
def test_fuzz_truncated_and_mutated_frames(kind: str, data: st.DataObject) -> None:
    frames = {
        "REQ_R": fr.encode_request(fr.OP_READ, b"seg-1", 3, 99, 4096),
        "REQ_W": fr.encode_request(fr.OP_WRITE, b"seg-1", 3, 99, 8) + b"12345678",
        "RESP": fr.encode_response(fr.ST_OK, 3, 4) + b"abcd",
        "ERR": fr.encode_error(fr.ST_UNKNOWN_SEGMENT, 3, "unknown segment 'x'"),
        "HELLO": fr.encode_hello("token"),
        "REPLY": fr.encode_hello_reply(fr.HELLO_OK),
    }
    raw = bytearray(frames[kind])
    cut = data.draw(st.integers(0, len(raw)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)),
                               max_size=4))
    for pos, val in flips:
        raw[pos] = val
    _decoders(bytes(raw[:cut]))
    _decoders(bytes(raw))
    # memoryview and bytearray inputs behave the same
    _decoders(memoryview(raw)[:cut])  # type: ignore[arg-type]
