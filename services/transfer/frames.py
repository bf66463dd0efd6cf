"""The TCP transfer protocol: struct-based binary framing. All integers are big-endian.

Handshake (once per connection, client first)::

    HELLO        4s magic b"MCTE" | u16 version | u16 token_len | token bytes (<= 1024)
    HELLO_REPLY  4s magic b"MCTE" | u16 version | u8 status | pad | u16 msg_len | msg (utf-8)

The server answers ``HELLO_OK`` or an error status with a message, and closes the connection
after an error (wrong token, unsupported version, ``HELLO_BUSY`` when it is at its connection
limit). Bad magic, a truncated hello, or a hello not complete within the server's handshake
deadline: it just closes. The token is compared in constant time and never logged.

Requests (client -> server), any number pipelined on one connection::

    REQUEST      2s magic b"MQ" | u8 op | u8 name_len | u32 req_id | u64 offset | u64 length
                 | name (name_len bytes, [A-Za-z0-9._-]{1,100})
                 | payload (WRITE only: `length` bytes)

Responses (server -> client), in request order::

    RESPONSE     2s magic b"MR" | u8 status | pad | u32 req_id | u64 length
                 | payload  (status OK and READ: `length` bytes of data)
                 | message  (status != OK: `length` bytes of utf-8, <= 4096)

For an OK WRITE response `length` is the number of bytes written and nothing follows.

RDMA connect (op ``OP_RDMA_CONNECT``, segment name ``RDMA_CONNECT_NAME``): the request's
payload is the client's `RdmaEndpoint` and an OK response's payload is the server's, which
lists each served segment's (name, address, rkey, length). Like every request it can only be
sent after the hello was accepted, so rkeys are only ever handed to authenticated peers. The
queue pair the server creates lives as long as this TCP connection. A server that cannot serve
RDMA answers ``ST_UNSUPPORTED`` with the reason; one older than this op closes the connection.

    RDMA_ENDPOINT  4s magic b"MCRD" | u8 version | u8 mtu | u8 rd_atomic | pad | u16 lid
                   | u16 n_regions | u32 qp_num | u32 psn | u32 max_message | 16s gid
                   | n_regions x (RDMA_REGION | name)
    RDMA_REGION    u8 name_len | pad(3) | u32 rkey | u64 addr | u64 length
`length` of one operation is at most ``MAX_OP_BYTES``; anything that breaks these rules is a
`ProtocolError` and the connection is closed. Range and segment errors are answered with an
error status and the connection stays usable.

The decoders here are pure (bytes in, values out) and raise only `ProtocolError`.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from mooncake_k8s.common.errors import ProtocolError

MAGIC = b"MCTE"
VERSION = 1
REQ_MAGIC = b"MQ"
RESP_MAGIC = b"MR"

HELLO = struct.Struct("!4sHH")
HELLO_REPLY = struct.Struct("!4sHBxH")
REQUEST = struct.Struct("!2sBBIQQ")
RESPONSE = struct.Struct("!2sBxIQ")
RDMA_ENDPOINT = struct.Struct("!4sBBBxHHIII16s")
RDMA_REGION = struct.Struct("!BxxxIQQ")

OP_READ = 1
OP_WRITE = 2
OP_RDMA_CONNECT = 3
OPS = {OP_READ: "READ", OP_WRITE: "WRITE", OP_RDMA_CONNECT: "RDMA_CONNECT"}
RDMA_CONNECT_NAME = b"rdma"
"""The segment-name field of an RDMA connect request (the framing needs one; it names none)."""

HELLO_OK = 0
HELLO_AUTH_FAILED = 1
HELLO_BAD_VERSION = 2
HELLO_BUSY = 3  # authenticated, but the server is at its connection limit: retry later
HELLO_STATUSES = {HELLO_OK, HELLO_AUTH_FAILED, HELLO_BAD_VERSION, HELLO_BUSY}

ST_OK = 0
ST_UNKNOWN_SEGMENT = 1
ST_OUT_OF_RANGE = 2
ST_TOO_LARGE = 3
ST_BAD_REQUEST = 4
ST_INTERNAL = 5
ST_UNSUPPORTED = 6  # RDMA connect: this server cannot serve RDMA (the message says why)
STATUSES = {
    ST_OK: "ok",
    ST_UNKNOWN_SEGMENT: "unknown segment",
    ST_OUT_OF_RANGE: "out of range",
    ST_TOO_LARGE: "too large",
    ST_BAD_REQUEST: "bad request",
    ST_INTERNAL: "internal error",
    ST_UNSUPPORTED: "unsupported",
}

MAX_TOKEN = 1024
MAX_NAME = 100
MAX_MESSAGE = 4096
MAX_OP_BYTES = 1 << 36
MAX_OFFSET = 1 << 48
MAX_RDMA_ENDPOINT = 1 << 20
"""Largest RDMA endpoint payload either side accepts (about 20,000 regions)."""
MAX_RDMA_REGIONS = 8192
RDMA_MAGIC = b"MCRD"
RDMA_VERSION = 1

_NAME_RE = re.compile(rb"[A-Za-z0-9._-]{1,100}")

Buf = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Request:
    op: int
    name: str
    req_id: int
    offset: int
    length: int
    payload: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    req_id: int
    length: int
    payload: bytes = b""

    @property
    def message(self) -> str:
        return "" if self.status == ST_OK else self.payload.decode("utf-8", "replace")


# -- handshake ---------------------------------------------------------------------------------


def encode_hello(token: str) -> bytes:
    tok = token.encode()
    if len(tok) > MAX_TOKEN:
        raise ValueError(f"cluster token longer than {MAX_TOKEN} bytes")
    return HELLO.pack(MAGIC, VERSION, len(tok)) + tok


def decode_hello_header(data: Buf, pos: int = 0) -> tuple[int, int]:
    """(version, token_len) of a hello; the version is returned, not checked."""
    if len(data) - pos < HELLO.size:
        raise ProtocolError(f"truncated hello: {len(data) - pos} of {HELLO.size} bytes")
    magic, version, tlen = HELLO.unpack_from(data, pos)
    if magic != MAGIC:
        raise ProtocolError(f"bad hello magic {bytes(magic)!r}")
    if tlen > MAX_TOKEN:
        raise ProtocolError(f"hello token length {tlen} over limit {MAX_TOKEN}")
    return int(version), int(tlen)


def decode_hello(data: Buf) -> tuple[int, bytes, int]:
    """(version, token, bytes consumed) of a complete hello."""
    version, tlen = decode_hello_header(data)
    end = HELLO.size + tlen
    if len(data) < end:
        raise ProtocolError(f"truncated hello token: {len(data) - HELLO.size} of {tlen} bytes")
    return version, bytes(data[HELLO.size : end]), end


def encode_hello_reply(status: int, message: str = "") -> bytes:
    msg = message.encode()[:MAX_MESSAGE]
    return HELLO_REPLY.pack(MAGIC, VERSION, status, len(msg)) + msg


def decode_hello_reply_header(data: Buf, pos: int = 0) -> tuple[int, int]:
    """(status, message length) of a hello reply."""
    if len(data) - pos < HELLO_REPLY.size:
        raise ProtocolError(
            f"truncated hello reply: {len(data) - pos} of {HELLO_REPLY.size} bytes"
        )
    magic, _version, status, mlen = HELLO_REPLY.unpack_from(data, pos)
    if magic != MAGIC:
        raise ProtocolError(f"bad hello reply magic {bytes(magic)!r}")
    if status not in HELLO_STATUSES:
        raise ProtocolError(f"unknown hello reply status {status}")
    if mlen > MAX_MESSAGE:
        raise ProtocolError(f"hello reply message length {mlen} over limit {MAX_MESSAGE}")
    return int(status), int(mlen)


def decode_hello_reply(data: Buf) -> tuple[int, str, int]:
    """(status, message, bytes consumed) of a complete hello reply."""
    status, mlen = decode_hello_reply_header(data)
    end = HELLO_REPLY.size + mlen
    if len(data) < end:
        raise ProtocolError("truncated hello reply message")
    return status, bytes(data[HELLO_REPLY.size : end]).decode("utf-8", "replace"), end


# -- requests ----------------------------------------------------------------------------------


def encode_name(name: str) -> bytes:
    raw = name.encode()
    if not _NAME_RE.fullmatch(raw):
        raise ProtocolError(f"invalid segment name {name!r}")
    return raw


def decode_name(raw: Buf) -> str:
    raw = bytes(raw)
    if not _NAME_RE.fullmatch(raw):
        raise ProtocolError(f"invalid segment name bytes {raw[:MAX_NAME]!r}")
    return raw.decode("ascii")


def encode_request(op: int, name: bytes, req_id: int, offset: int, length: int) -> bytes:
    """Header plus name; a WRITE's payload is sent right after it."""
    return REQUEST.pack(REQ_MAGIC, op, len(name), req_id, offset, length) + name


def decode_request_header(data: Buf, pos: int = 0) -> tuple[int, int, int, int, int]:
    """(op, name_len, req_id, offset, length) of the fixed request header at `pos`."""
    if len(data) - pos < REQUEST.size:
        raise ProtocolError(f"truncated request header: {len(data) - pos} of {REQUEST.size} bytes")
    magic, op, nlen, rid, off, length = REQUEST.unpack_from(data, pos)
    if magic != REQ_MAGIC:
        raise ProtocolError(f"bad request magic {bytes(magic)!r}")
    if op not in OPS:
        raise ProtocolError(f"unknown op code {op}")
    if nlen == 0 or nlen > MAX_NAME:
        raise ProtocolError(f"segment name length {nlen} outside 1..{MAX_NAME}")
    if length > MAX_OP_BYTES:
        raise ProtocolError(f"length {length} over limit {MAX_OP_BYTES}")
    if op == OP_RDMA_CONNECT and length > MAX_RDMA_ENDPOINT:
        raise ProtocolError(f"RDMA endpoint of {length} bytes over limit {MAX_RDMA_ENDPOINT}")
    if off > MAX_OFFSET:
        raise ProtocolError(f"offset {off} over limit {MAX_OFFSET}")
    return op, nlen, rid, off, length


def decode_request(data: Buf) -> tuple[Request, int]:
    """One complete request (with a WRITE's payload) and the number of bytes it used."""
    op, nlen, rid, off, length = decode_request_header(data)
    end = REQUEST.size + nlen
    if len(data) < end:
        raise ProtocolError(f"truncated segment name: {len(data) - REQUEST.size} of {nlen} bytes")
    name = decode_name(data[REQUEST.size : end])
    payload = b""
    if op in (OP_WRITE, OP_RDMA_CONNECT):
        if len(data) - end < length:
            raise ProtocolError(f"truncated WRITE payload: {len(data) - end} of {length} bytes")
        payload = bytes(data[end : end + length])
        end += length
    return Request(op, name, rid, off, length, payload), end


# -- responses ---------------------------------------------------------------------------------


def encode_response(status: int, req_id: int, length: int) -> bytes:
    return RESPONSE.pack(RESP_MAGIC, status, req_id, length)


def encode_error(status: int, req_id: int, message: str) -> bytes:
    msg = message.encode()[:MAX_MESSAGE]
    return RESPONSE.pack(RESP_MAGIC, status, req_id, len(msg)) + msg


def decode_response_header(data: Buf, pos: int = 0) -> tuple[int, int, int]:
    """(status, req_id, length) of the fixed response header at `pos`."""
    if len(data) - pos < RESPONSE.size:
        raise ProtocolError(
            f"truncated response header: {len(data) - pos} of {RESPONSE.size} bytes"
        )
    magic, status, rid, length = RESPONSE.unpack_from(data, pos)
    if magic != RESP_MAGIC:
        raise ProtocolError(f"bad response magic {bytes(magic)!r}")
    if status not in STATUSES:
        raise ProtocolError(f"unknown response status {status}")
    if status != ST_OK and length > MAX_MESSAGE:
        raise ProtocolError(f"error message length {length} over limit {MAX_MESSAGE}")
    if length > MAX_OP_BYTES:
        raise ProtocolError(f"response length {length} over limit {MAX_OP_BYTES}")
    return int(status), int(rid), int(length)


def decode_response(data: Buf, op: int = OP_READ) -> tuple[Response, int]:
    """One complete response to a request of kind `op` and the number of bytes it used."""
    status, rid, length = decode_response_header(data)
    end = RESPONSE.size
    if status != ST_OK or op in (OP_READ, OP_RDMA_CONNECT):
        if len(data) - end < length:
            raise ProtocolError(f"truncated response body: {len(data) - end} of {length} bytes")
        return Response(status, rid, length, bytes(data[end : end + length])), end + length
    return Response(status, rid, length), end


# -- RDMA endpoints ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaRegion:
    """A segment registered for RDMA at the server: remote reads and writes of
    `[addr, addr + length)` use `rkey`."""

    name: str
    addr: int
    rkey: int
    length: int


@dataclass(frozen=True)
class RdmaEndpoint:
    """One side of an RC queue pair, as exchanged in an RDMA connect: what the other side's
    INIT -> RTR -> RTS transitions need, plus (server side) the registered segments."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes
    mtu: int
    rd_atomic: int
    max_message: int
    regions: tuple[RdmaRegion, ...] = ()


def encode_rdma_endpoint(ep: RdmaEndpoint) -> bytes:
    """Raises ValueError for a field out of its wire range (a bug on our side, not the peer's)."""
    if not (0 <= ep.qp_num < 1 << 24 and 0 <= ep.psn < 1 << 24 and 0 <= ep.lid < 1 << 16):
        raise ValueError(f"RDMA endpoint field out of range: {ep}")
    if len(ep.gid) != 16 or not 1 <= ep.mtu <= 5 or not 0 <= ep.rd_atomic < 256:
        raise ValueError(f"RDMA endpoint gid/mtu/rd_atomic out of range: {ep}")
    if len(ep.regions) > MAX_RDMA_REGIONS:
        raise ValueError(f"{len(ep.regions)} RDMA regions, over limit {MAX_RDMA_REGIONS}")
    parts = [RDMA_ENDPOINT.pack(RDMA_MAGIC, RDMA_VERSION, ep.mtu, ep.rd_atomic, ep.lid,
                                len(ep.regions), ep.qp_num, ep.psn,
                                min(ep.max_message, 0xFFFFFFFF), ep.gid)]
    for r in ep.regions:
        name = encode_name(r.name)
        if not (0 <= r.rkey < 1 << 32 and 0 <= r.addr < 1 << 64 and 0 <= r.length < 1 << 64):
            raise ValueError(f"RDMA region field out of range: {r}")
        parts.append(RDMA_REGION.pack(len(name), r.rkey, r.addr, r.length) + name)
    out = b"".join(parts)
    if len(out) > MAX_RDMA_ENDPOINT:
        raise ValueError(f"RDMA endpoint of {len(out)} bytes over limit {MAX_RDMA_ENDPOINT}")
    return out


def decode_rdma_endpoint(data: Buf) -> RdmaEndpoint:
    """The peer's endpoint; anything malformed (a hostile or buggy peer) is a ProtocolError."""
    data = bytes(data)
    if len(data) > MAX_RDMA_ENDPOINT:
        raise ProtocolError(f"RDMA endpoint of {len(data)} bytes over limit {MAX_RDMA_ENDPOINT}")
    if len(data) < RDMA_ENDPOINT.size:
        raise ProtocolError(f"truncated RDMA endpoint: {len(data)} of {RDMA_ENDPOINT.size} bytes")
    (magic, version, mtu, rd_atomic, lid, count, qp_num, psn, max_message,
     gid) = RDMA_ENDPOINT.unpack_from(data, 0)
    if magic != RDMA_MAGIC:
        raise ProtocolError(f"bad RDMA endpoint magic {magic!r}")
    if version != RDMA_VERSION:
        raise ProtocolError(f"unsupported RDMA endpoint version {version}")
    if not 1 <= mtu <= 5:
        raise ProtocolError(f"RDMA endpoint mtu code {mtu} outside 1..5")
    if qp_num >= 1 << 24 or psn >= 1 << 24:
        raise ProtocolError(f"RDMA endpoint qp_num {qp_num} or psn {psn} over 24 bits")
    if count > MAX_RDMA_REGIONS:
        raise ProtocolError(f"{count} RDMA regions, over limit {MAX_RDMA_REGIONS}")
    regions = _decode_rdma_regions(data, count)
    return RdmaEndpoint(qp_num, psn, lid, gid, mtu, rd_atomic, max_message, regions)


def _decode_rdma_regions(data: bytes, count: int) -> tuple[RdmaRegion, ...]:
    """The `count` regions after an endpoint's fixed part, which must end `data` exactly."""
    pos = RDMA_ENDPOINT.size
    regions: list[RdmaRegion] = []
    for _ in range(count):
        if len(data) - pos < RDMA_REGION.size:
            raise ProtocolError("truncated RDMA region")
        nlen, rkey, addr, length = RDMA_REGION.unpack_from(data, pos)
        pos += RDMA_REGION.size
        if len(data) - pos < nlen:
            raise ProtocolError("truncated RDMA region name")
        name = decode_name(data[pos : pos + nlen])
        pos += nlen
        if addr + length > 1 << 64:
            raise ProtocolError(f"RDMA region {name!r} wraps the address space")
        regions.append(RdmaRegion(name, addr, rkey, length))
    if pos != len(data):
        raise ProtocolError(f"{len(data) - pos} trailing bytes after the RDMA endpoint")
    return tuple(regions)
