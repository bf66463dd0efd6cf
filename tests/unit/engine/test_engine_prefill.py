"""Prefill: import/compute identity, block export, rejected blocks, bad inputs (real model)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mooncake_k8s.common.blocks import (
    HEADER_SIZE,
    BlockLayout,
    decode_block,
    decode_header,
    encode_block,
)
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.embedded import Engine, SamplingParams
from mooncake_k8s.engine.embedded.testing import GREEDY, all_blocks, decode_alone, poison_scratch
from mooncake_k8s.engine.embedded.testing import prompt_tokens as prompt


# Under a block, one exact block, two and a tail, five and a tail.
@pytest.mark.parametrize("n", [37, 128, 133, 330])
def test_greedy_identical_whether_prefix_imported_or_computed(fresh: Engine, n: int) -> None:
    engine = fresh
    ids = prompt(engine, n)
    cold = engine.prefill(ids, [], GREEDY, seq_id="cold")
    full = [b for _, b in cold.new_blocks]
    assert [i for i, _ in cold.new_blocks] == list(range(n // 64))
    assert (cold.tail_block is None) == (n % 64 == 0)
    assert (cold.cached_tokens, cold.computed_tokens, cold.rejected_blocks) == (0, n, 0)

    poison_scratch(engine)  # an import that misses a byte would now change the output
    hit = engine.prefill(ids, full, GREEDY, seq_id="hit")
    assert (hit.first_token, hit.text) == (cold.first_token, cold.text)
    assert hit.new_blocks == [] and hit.rejected_blocks == 0
    assert hit.tail_block == cold.tail_block, "tail KV must be the same bits"
    if full and n % 64 == 0:  # full hit: only the last token is recomputed
        assert (hit.cached_tokens, hit.computed_tokens) == (n - 1, 1)
    else:
        assert (hit.cached_tokens, hit.computed_tokens) == (len(full) * 64, n - len(full) * 64)

    half = engine.prefill(ids, full[: len(full) // 2], GREEDY, seq_id="half")
    assert half.first_token == cold.first_token
    assert half.new_blocks == cold.new_blocks[len(full) // 2 :], "recomputed blocks differ"
    assert half.tail_block == cold.tail_block

    cold_tokens, cold_text, _ = decode_alone(
        engine, "c", ids, all_blocks(cold), cold.first_token, GREEDY
    )
    hit_tokens, hit_text, _ = decode_alone(
        engine, "h", ids, all_blocks(hit, full), hit.first_token, GREEDY
    )
    half_tokens, _, _ = decode_alone(
        engine, "x", ids, all_blocks(half, full[: len(full) // 2]), half.first_token, GREEDY
    )
    assert len(cold_tokens) == 20
    assert hit_tokens == cold_tokens and half_tokens == cold_tokens
    assert hit_text == cold_text


def test_matches_the_hugging_face_reference(fresh: Engine) -> None:
    """Our forward pass computes the same function as transformers' (greedy, 12 tokens)."""
    from transformers import AutoModelForCausalLM

    from mooncake_k8s.engine.loading import ensure_builtin

    engine = fresh
    ids = engine.chat_tokens([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0, max_tokens=12)
    res = engine.prefill(ids, [], params)
    ours, text, _ = decode_alone(engine, "ref", ids, all_blocks(res), res.first_token, params)
    hf: Any = AutoModelForCausalLM.from_pretrained(ensure_builtin(progress=False)[0])
    hf.eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=len(ours), do_sample=False,
        )
    ref = out[0, len(ids):].tolist()
    assert ours[: len(ref)] == ref
    assert "Paris" in res.text + text


def test_exported_blocks_follow_the_block_contract(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 150)
    res = engine.prefill(ids, [], GREEDY)
    layout = engine.layout
    assert layout == BlockLayout(engine.fingerprint, "float32", 30, 3, 64)
    for _, blk in res.new_blocks:
        header, payload = decode_block(blk, layout)
        assert header.tokens == 64 and len(payload) == layout.payload_bytes(64)
        assert len(blk) == layout.block_bytes(64)
    assert res.tail_block is not None
    assert decode_header(res.tail_block).tokens == 150 - 128
    # payload is [layer, k|v, kv_head, token, head_dim]: block 1 holds tokens 64..127, so
    # the tail computed again from blocks 0 and 1 must agree with a cold run
    again = engine.prefill(ids, [b for _, b in res.new_blocks], GREEDY)
    assert again.tail_block == res.tail_block


def test_imports_accept_memoryview_numpy_and_tensors(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 200)
    cold = engine.prefill(ids, [], GREEDY)
    blocks = [b for _, b in cold.new_blocks]
    forms = [
        memoryview(blocks[0]),
        np.frombuffer(blocks[1], dtype=np.uint8),
        torch.frombuffer(bytearray(blocks[2]), dtype=torch.uint8),
    ]
    res = engine.prefill(ids, forms, GREEDY)
    assert res.cached_tokens == 192 and res.rejected_blocks == 0
    assert res.first_token == cold.first_token and res.tail_block == cold.tail_block


def _corrupt(kind: str, blocks: list[bytes], engine: Engine) -> bytes:
    good = blocks[1]
    if kind == "payload":
        bad = bytearray(good)
        bad[HEADER_SIZE + 1000] ^= 0x40
        return bytes(bad)
    if kind == "header":
        bad = bytearray(good)
        bad[20] ^= 0x01
        return bytes(bad)
    if kind == "truncated":
        return good[:-4]
    if kind == "other-model":
        other = BlockLayout(b"x" * 16, "float32", 30, 3, 64)
        return encode_block(other, 64, good[HEADER_SIZE:])
    if kind == "token-count":  # right layout, 32 tokens where a block holds 64
        half = engine.layout.payload_bytes(32)
        return encode_block(engine.layout, 32, good[HEADER_SIZE : HEADER_SIZE + half])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["payload", "header", "truncated", "other-model", "token-count"])
def test_bad_block_is_rejected_and_recomputed(fresh: Engine, kind: str) -> None:
    engine = fresh
    ids = prompt(engine, 300, variant=1)
    cold = engine.prefill(ids, [], GREEDY)
    blocks = [bytes(b) for _, b in cold.new_blocks]
    assert len(blocks) == 4
    poison_scratch(engine)
    imported = [blocks[0], _corrupt(kind, blocks, engine), blocks[2], blocks[3]]
    res = engine.prefill(ids, imported, GREEDY)
    assert res.rejected_blocks == 3, "the chain is cut at the bad block"
    assert (res.cached_tokens, res.computed_tokens) == (64, 300 - 64)
    assert res.new_blocks == cold.new_blocks[1:]
    assert (res.first_token, res.tail_block) == (cold.first_token, cold.tail_block)


def test_full_hit_computes_one_token(fresh: Engine) -> None:
    """A full-prefix hit recomputes one token (the last, for its logits) and nothing else; how
    much time that saves is `bench/engine_bench.py`'s to measure."""
    engine = fresh
    ids = prompt(engine, 512, variant=2)
    cold = engine.prefill(ids, [], GREEDY)
    blocks = [b for _, b in cold.new_blocks]
    hit = engine.prefill(ids, blocks, GREEDY)
    assert cold.computed_tokens == 512 and cold.cached_tokens == 0
    assert (hit.computed_tokens, hit.cached_tokens) == (1, 511)
    assert hit.first_token == cold.first_token and not hit.new_blocks


def test_bad_prompts_get_specific_errors(engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        engine.prefill([], [], GREEDY)
    with pytest.raises(InvalidArgument, match=r"8193 tokens; the model's context is 8192"):
        engine.prefill([1] * 8193, [], GREEDY)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.prefill([1, 49152], [], GREEDY)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.prefill([-1, 5], [], GREEDY)
    with pytest.raises(InvalidArgument, match="must be integers"):
        engine.prefill(["a", "b"], [], GREEDY)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="1 imported blocks for a prompt of 10 tokens"):
        engine.prefill(list(range(10)), [b"x"], GREEDY)


def test_first_token_can_finish_the_request(fresh: Engine) -> None:
    engine = fresh
    ids = engine.chat_tokens([{"role": "user", "content": "What is the capital of France?"}])
    one = engine.prefill(ids, [], SamplingParams(temperature=0, max_tokens=1))
    assert (one.finished, one.finish_reason) == (True, "length")
    assert one.text == engine.detokenize([one.first_token])
    stop = engine.prefill(ids, [], SamplingParams(temperature=0, stop=(one.text.strip(),)))
    assert (stop.finished, stop.finish_reason, stop.text.strip()) == (True, "stop", "")
