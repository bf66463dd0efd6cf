"""Decoding request bodies at the Conductor's edge: every unusable body is a specific 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncake_k8s.conductor.http.bodies import EdgeLimits, check_json_value, decode_json
from mooncake_k8s.conductor.http.protocol import ApiError

DEPTH = 64


def _refused(raw: bytes, max_depth: int = DEPTH) -> ApiError:
    with pytest.raises(ApiError) as e:
        decode_json(raw, max_depth)
    assert e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


def test_a_valid_body_decodes() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo 😀"}], "seed": -5}
    assert decode_json(json.dumps(body).encode(), DEPTH) == body
    # An escaped surrogate *pair* is one valid character, not a lone surrogate.
    assert decode_json(b'{"p": "\\ud83d\\ude00"}', DEPTH) == {"p": "\U0001f600"}


@pytest.mark.parametrize("depth", [100, 900, 5_000, 100_000])
def test_deep_nesting_is_400_without_recursion(depth: int) -> None:
    e = _refused(b"[" * depth + b"]" * depth)
    assert e.code == "json_too_deep" and f"deeper than {DEPTH}" in e.message
    e = _refused(b'{"model": "m", "x": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}")
    assert e.code == "json_too_deep"


def test_depth_limit_is_exact() -> None:
    assert decode_json(b"[" * DEPTH + b"]" * DEPTH, DEPTH) == _nested(DEPTH)
    e = _refused(b"[" * (DEPTH + 1) + b"]" * (DEPTH + 1))
    assert e.param == ".".join(["0"] * DEPTH)


def _nested(depth: int) -> Any:
    v: Any = []
    for _ in range(depth - 1):
        v = [v]
    return v


@pytest.mark.parametrize(("raw", "param", "fragment"), [
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content",
     "\\ud800 at character 1"),
    (b'{"stop": ["ok", "\\udfff"]}', "stop.1", "\\udfff"),
    (b'{"model": "\\udc00"}', "model", "surrogate"),
    (b'{"\\ud800key": 1}', "\ud800key", "surrogate"),
    (b'"\\ud800"', None, "surrogate"),
])
def test_lone_surrogates_are_400_naming_the_field(raw: bytes, param: str | None,
                                                  fragment: str) -> None:
    e = _refused(raw)
    assert e.param == param
    assert fragment in e.message and "not valid Unicode" in e.message
    json.dumps(e.body())  # the error itself must be serialisable


@pytest.mark.parametrize(("raw", "fragment"), [
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8: invalid start byte at byte 12"),
    (b'{"prompt": "\xc3"}', "not valid UTF-8"),
    (b'{"temperature": NaN}', "NaN is not a JSON value"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON value"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "5001 digits is out of range"),
    (b'{"seed": -' + b"9" * 41 + b"}", "42 digits"),
    (b"{not json", "invalid JSON body"),
    (b"", "invalid JSON body"),
])
def test_undecodable_bodies_are_400(raw: bytes, fragment: str) -> None:
    assert fragment in _refused(raw).message


def test_long_integers_within_the_digit_limit_still_parse() -> None:
    # 2**64 has 20 digits: it parses, and the field's own bound refuses it with its name.
    assert decode_json(b'{"seed": 18446744073709551616}', DEPTH) == {"seed": 2**64}
    assert decode_json(b'{"seed": -' + b"9" * 40 + b"}", DEPTH) == {"seed": -int("9" * 40)}


def test_check_json_value_walks_long_token_lists() -> None:
    check_json_value({"prompt": list(range(200_000))}, DEPTH)


@pytest.mark.parametrize("field", ["max_body_bytes", "max_json_depth", "header_timeout_s",
                                   "body_timeout_s", "idle_timeout_s"])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EdgeLimits(**{field: 0})
