"""Reading and decoding request bodies at the Conductor's edge, with limits checked first.

Whatever a client sends, the answer must be a 4xx naming what was wrong, and refusing must
cost less than serving: the size limit is checked against Content-Length before a byte of the
body is read, and again while reading (chunked bodies have no length), so an oversized body
never reaches the JSON parser or the tokenizer. `decode_json` turns every way JSON text can be
unusable into `ApiError(400)`: invalid UTF-8, NaN/Infinity (not JSON), integer literals too
long to convert, nesting deeper than the limit (Python's json module recurses, so a body
100,000 levels deep would otherwise raise RecursionError), and lone UTF-16 surrogates, which
JSON's \\uD800 escapes can produce but no UTF-8 encoder (tokenizer, protobuf) accepts.

`api` calls `read_body` then `decode_json`; both are plain functions the unit tests call.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mooncake_k8s.conductor.http.protocol import ApiError


@dataclass(frozen=True)
class EdgeLimits:
    """What one HTTP client may cost the Conductor before it is refused or disconnected."""

    max_body_bytes: int = 4 << 20
    """413 above this many bytes of request body. 4 MiB is ~50x the longest prompt the built-in
    model's 8k context can hold as text, and tokenising 4 MiB still costs ~3.4 s of CPU on the
    dev VM, so a far larger default would only make refusals expensive."""
    max_json_depth: int = 64
    """400 for JSON nested deeper. An OpenAI request needs about 5 levels (messages, parts)."""
    header_timeout_s: float = 10.0
    """Close a connection that has not sent a whole request head this long after it opened or,
    on a kept-alive connection, after the first byte of its next request (slowloris)."""
    body_timeout_s: float = 30.0
    """408 when the whole body has not arrived this long after the request head."""
    idle_timeout_s: float = 75.0
    """Close a kept-alive connection idle this long; above the 60 s that proxies in front
    (nginx upstream keepalive, cloud load balancers) commonly keep idle backend connections, so
    the proxy, not the Conductor, closes first and never sends on a connection being closed."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "header_timeout_s", "body_timeout_s",
                     "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


MAX_INT_DIGITS = 40
"""Integer literals longer than this are refused while parsing: every integer field we take
fits in 20 digits, and Python refuses to convert more than 4300 anyway (a ValueError that
used to surface as a 500)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: web.Request, limits: EdgeLimits) -> bytes:
    """The whole body, or ApiError 413 (too large), 415 (compressed) or 408 (too slow)."""
    limit = limits.max_body_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise body_too_large(length, limit)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Never inflated: a few KiB of gzip can expand to gigabytes before any limit applies.
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported; send the body "
                            "uncompressed", code="unsupported_content_encoding")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise body_too_large(None, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within "
                            f"{limits.body_timeout_s:g} s ({size} bytes received)",
                       code="request_timeout") from None
    return b"".join(chunks)


def body_too_large(length: int | None, limit: int) -> ApiError:
    said = f"is {length} bytes" if length is not None else "is larger than that"
    return ApiError(413, f"request body {said}; this server accepts at most {limit} bytes",
                    code="request_too_large")


def decode_json(raw: bytes, max_depth: int) -> Any:
    """Parse a JSON body, or raise ApiError(400) that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e.reason} at byte "
                            f"{e.start}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int)
    except RecursionError:
        raise ApiError(400, f"invalid JSON body: nested deeper than {max_depth} levels",
                       code="json_too_deep") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None
    except _Refused as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None
    check_json_value(body, max_depth)
    return body


class _Refused(ValueError):
    """A literal the JSON decoder hooks refuse (json.loads lets ValueErrors through)."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON value")


def _bounded_int(literal: str) -> int:
    if len(literal) > MAX_INT_DIGITS + (literal[0] == "-"):
        raise _Refused(f"integer literal of {len(literal)} digits is out of range")
    return int(literal)


def check_json_value(value: Any, max_depth: int) -> None:
    """Depth and Unicode checks over a decoded JSON value, without recursion. The 400 names
    the field (`messages.0.content`) that holds a lone surrogate. Scalars other than strings
    are never pushed, so a long list of token ids costs one C-level type check per item."""
    if isinstance(value, str):
        _check_text(value, (), None)
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = []
    if isinstance(value, dict | list):
        stack.append((value, 1, ()))
    while stack:
        v, depth, path = stack.pop()
        if depth > max_depth:
            raise ApiError(400, f"invalid JSON body: nested deeper than {max_depth} levels",
                           param=_dotted(path) or None, code="json_too_deep")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, item in items:
            if isinstance(k, str):
                _check_text(k, path, k)
            if isinstance(item, str):
                _check_text(item, path, k)
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1, (*path, k)))


def _check_text(s: str, path: tuple[str | int, ...], key: str | int | None) -> None:
    m = _SURROGATE.search(s)
    if m is not None:
        where = _dotted(path if key is None else (*path, key))
        raise ApiError(400, f"{where + ': ' if where else ''}contains a lone UTF-16 surrogate "
                            f"(\\u{ord(m.group()):04x} at character {m.start()}), which is "
                            "not valid Unicode", param=where or None)


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)
