"""Chat template, tokenisation and incremental detokenisation with the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.embedded import Engine
from mooncake_k8s.engine.embedded.detokenizing import TextStream


def test_chat_template_ends_with_the_assistant_prompt(engine: Engine) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    tok: Any = engine.tokenizer
    ids = engine.chat_tokens(msgs)
    text = tok.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # without a system message the model's default one is used
    default = tok.decode(engine.chat_tokens([{"role": "user", "content": "x"}]))
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
         r"messages\[1\]\.content must be a string"),
    ],
)
def test_bad_messages_get_specific_errors(engine: Engine, messages: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        engine.chat_tokens(messages)  # type: ignore[arg-type]


def test_encode_and_detokenize_round_trip(engine: Engine) -> None:
    text = "Mooncake keeps KV caches: 64 tokens per block."
    assert engine.detokenize(engine.encode(text)) == text
    with pytest.raises(InvalidArgument, match="prompt must be a string"):
        engine.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, plain ASCII.",
        "Emoji 🌍🚀 and CJK 世界你好 and accents: café, naïve, Ångström.",
        "  leading spaces\n\nnew lines\ttabs  ",
        "\U0001d518\U0001d52b\U0001d526 math letters, ZWJ family \U0001f469\u200d\U0001f467",
    ],
)
def test_incremental_text_equals_whole_decode(engine: Engine, text: str) -> None:
    prompt = engine.encode("Say something:")
    ids = engine.encode(text)
    stream = TextStream(engine.tokenizer, prompt, ())
    deltas = [stream.add(t) for t in ids]
    out = "".join(deltas) + stream.flush()
    assert out == engine.detokenize(ids)
    assert all("\ufffd" not in d for d in deltas), "a partial character was released"


def test_stop_string_spanning_tokens_is_cut(engine: Engine) -> None:
    ids = engine.encode("The answer is forty-two, as everyone knows.")
    stream = TextStream(engine.tokenizer, [], ("ty-tw",))
    out = ""
    for t in ids:
        out += stream.add(t)
        if stream.stopped:
            break
    assert stream.stopped and out == "The answer is for" and stream.text == out
    assert stream.add(ids[-1]) == "" and stream.flush() == ""


def test_flush_releases_withheld_text(engine: Engine) -> None:
    ids = engine.encode("Ends with a partial stop: ST")
    stream = TextStream(engine.tokenizer, [], ("STOP",))
    out = "".join(stream.add(t) for t in ids)
    assert out.endswith("stop: ") and not stream.stopped
    assert out + stream.flush() == "Ends with a partial stop: ST"
