"""The sidecar's wire protocol over its Unix socket: small typed frames, data never inline.

Bytes move through the shared staging segment (/dev/shm), so frames carry only control: a
fixed header then a JSON body (keys and spans are a few KiB; JSON keeps the protocol readable
with `socat` and needs no schema compiler).

    header  = magic "MCSC" | version u8 | kind u8 | code u16 | body length u32   (12 bytes)
    request : kind=REQUEST,  code=Op,     body = JSON object of the op's arguments
    response: kind=RESPONSE, code=Status, body = JSON object (the result, or {"message"})

One request is in flight per connection, so no request ids. A frame with a bad magic, version,
kind or a length above `MAX_BODY` cannot be resynchronised: the sidecar answers `BAD_FRAME`
and closes the connection. A well-framed request with a bad body gets `BAD_REQUEST` and the
connection stays.

Staging segment layout: `STAGING_HEADER` bytes of header (magic, protocol version, the
sidecar's incarnation id) then `slots` equal slots. The incarnation in the mapped memory lets a
client prove that the mapping it holds is the one the sidecar it talks to created.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from typing import Any

from mooncake_k8s.common.errors import MooncakeError, ProtocolError

MAGIC = b"MCSC"
VERSION = 1
HEADER = struct.Struct("<4sBBHI")
MAX_BODY = 4 << 20
"""Largest body either side accepts (4096 keys of 1 KiB fit with room)."""
MAX_KEYS = 4096
MAX_KEY_LEN = 1024

STAGING_MAGIC = b"MCSS"
STAGING_HEADER = 4096
"""Bytes reserved at the start of the staging segment; slots start here (page-aligned)."""
STAGING_ID = struct.Struct("<4sB3x16s")
"""magic, protocol version, padding, incarnation (16 raw bytes) at offset 0 of the segment."""
SLOT_ALIGN = 4096


class Kind(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2


class Op(enum.IntEnum):
    HELLO = 1
    PREFIX_EXISTS = 2
    PUT = 3
    GET = 4
    STATS = 5


class Status(enum.IntEnum):
    """The one error enum of the protocol; OK is 0."""

    OK = 0
    BAD_FRAME = 1  # framing broken: the connection is closed after this answer
    BAD_VERSION = 2
    UNAUTHENTICATED = 3
    BAD_REQUEST = 4  # malformed body, unknown op, span outside the slot ...
    NEED_HELLO = 5
    NO_SLOT = 6  # every staging slot is held by another connection
    POOL_UNAVAILABLE = 7  # the store could not be reached
    INTERNAL = 8


class SidecarError(MooncakeError):
    """The sidecar answered a request with an error status."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


def encode(kind: Kind, code: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_BODY:
        raise ProtocolError(f"frame body of {len(data)} bytes exceeds {MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, kind, code, len(data)) + data


def decode_header(raw: bytes) -> tuple[Kind, int, int]:
    """(kind, code, body length) of a frame header; ProtocolError when it is not ours."""
    magic, version, kind, code, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
    if kind not in (Kind.REQUEST, Kind.RESPONSE):
        raise ProtocolError(f"bad frame kind {kind}")
    if length > MAX_BODY:
        raise ProtocolError(f"frame body of {length} bytes exceeds {MAX_BODY}")
    return Kind(kind), code, length


def decode_body(data: bytes) -> dict[str, Any]:
    """The JSON object of a body; ValueError when it is not one."""
    try:
        body = json.loads(data) if data else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    return body


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes; ConnectionError on EOF (socket timeouts propagate)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[Kind, int, bytes]:
    kind, code, length = decode_header(recv_exact(sock, HEADER.size))
    return kind, code, recv_exact(sock, length) if length else b""


def staging_id(incarnation: bytes) -> bytes:
    return STAGING_ID.pack(STAGING_MAGIC, VERSION, incarnation)


def check_keys(body: dict[str, Any]) -> list[str]:
    keys = body.get("keys")
    if not isinstance(keys, list) or not all(
        isinstance(k, str) and 0 < len(k) <= MAX_KEY_LEN for k in keys
    ):
        raise ValueError(f"keys must be a list of 1..{MAX_KEY_LEN} character strings")
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request, above {MAX_KEYS}")
    return keys


def check_spans(body: dict[str, Any], n: int, slot_size: int) -> list[tuple[int, int]]:
    """The request's (offset, length) spans, each non-empty and inside a slot of `slot_size`."""
    spans = body.get("spans")
    if not isinstance(spans, list) or len(spans) != n:
        raise ValueError(f"spans must be a list of {n} [offset, length] pairs")
    out: list[tuple[int, int]] = []
    for s in spans:
        if (
            not isinstance(s, list) or len(s) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        ):
            raise ValueError(f"span {s!r} is not [offset, length]")
        off, length = s
        if off < 0 or length < 1 or off + length > slot_size:
            raise ValueError(f"span [{off}, {length}] is outside the slot of {slot_size} bytes")
        out.append((off, length))
    return out
