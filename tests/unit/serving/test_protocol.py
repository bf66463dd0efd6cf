"""Request validation and API-key parsing of the Conductor's front door (pure functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.conductor.http.api import load_api_keys
from mooncake_k8s.conductor.http.protocol import ApiError, ChatRequest, CompletionRequest, parse

MSG = [{"role": "user", "content": "hi"}]


def test_valid_chat_request_defaults() -> None:
    req = parse(ChatRequest, {"model": "m", "messages": MSG})
    assert req.temperature == 1.0 and req.top_p == 1.0 and req.stream is False
    assert req.stops() == [] and req.max_tokens is None


def test_stop_string_or_list() -> None:
    assert parse(ChatRequest, {"model": "m", "messages": MSG, "stop": "x"}).stops() == ["x"]
    assert parse(ChatRequest, {"model": "m", "messages": MSG, "stop": ["a", "b"]}).stops() == [
        "a", "b"]


@pytest.mark.parametrize(("body", "fragment"), [
    ({"model": "m", "messages": []}, "messages"),
    ({"messages": MSG}, "model"),
    ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MSG, "top_p": 0}, "top_p"),
    ({"model": "m", "messages": MSG, "temperature": -1}, "temperature"),
    ({"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"model": "m", "messages": MSG, "stop": [""]}, "non-empty"),
    ({"model": "m", "messages": MSG, "n": 2}, "n > 1"),
    ({"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "content"),
])
def test_invalid_chat_requests_name_the_field(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, body)
    assert e.value.status == 400
    assert fragment in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object() -> None:
    with pytest.raises(ApiError, match="JSON object"):
        parse(ChatRequest, [1, 2])


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", "hello"),
    ([1, 2, 3], [1, 2, 3]),
    (["only one"], "only one"),
    ([[4, 5]], [4, 5]),
])
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    assert parse(CompletionRequest, {"model": "m", "prompt": prompt}).prompt_input() == expected


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"]])
def test_completion_prompt_rejections(prompt: Any) -> None:
    req = parse(CompletionRequest, {"model": "m", "prompt": prompt})
    with pytest.raises(ApiError) as e:
        req.prompt_input()
    assert e.value.param == "prompt"


def test_text_content_parts_are_joined_and_images_refused() -> None:
    req = parse(ChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]})
    assert req.messages[0].text() == "ab"
    req = parse(ChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ApiError, match="text content"):
        req.messages[0].text()


def test_api_keys_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nsk-1 acme\n\nsk-2   # no tenant\n")
    assert load_api_keys(str(f)) == {"sk-1": "acme", "sk-2": ""}
    f.write_text("sk-1 a b\n")
    with pytest.raises(ValueError, match="KEY"):
        load_api_keys(str(f))
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API keys"):
        load_api_keys(str(f))


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("seed", 2**64, "less than or equal to 9223372036854775807"),
    ("seed", 2**63, "less than or equal to 9223372036854775807"),
    ("seed", -(2**63) - 1, "greater than or equal to -9223372036854775808"),
    ("max_tokens", 2**80, "less than or equal to 2147483647"),
    ("max_completion_tokens", 2**31, "less than or equal to 2147483647"),
    ("n", 2**70, "less than or equal to 2147483647"),
    ("top_k", 40, "'top_k' is not supported"),
    ("top_k", 2**70, "'top_k' is not supported"),
    ("top_logprobs", 2**70, "'top_logprobs' is not supported"),
])
def test_integer_fields_are_bounded_and_named(field: str, value: int, fragment: str) -> None:
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, {"model": "m", "messages": MSG, field: value})
    assert e.value.status == 400 and e.value.param == field
    assert fragment in e.value.message


@pytest.mark.parametrize(("field", "value"), [
    ("seed", 2**63 - 1), ("seed", -(2**63)), ("max_tokens", 2**31 - 1), ("top_k", -1),
    ("top_k", 0),
])
def test_integer_bounds_are_inclusive(field: str, value: int) -> None:
    parse(ChatRequest, {"model": "m", "messages": MSG, field: value})
