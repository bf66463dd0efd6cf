"""The KV block contract: chained keys and the header/payload codec."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_k8s.common.blocks import (
    HEADER_SIZE,
    BlockLayout,
    KeyNamespace,
    block_keys,
    decode_block,
    decode_header,
    encode_block,
)
from mooncake_k8s.common.errors import IntegrityError, InvalidArgument

NS = KeyNamespace(model_fingerprint="smollm2-135m", dtype="float16", block_tokens=4)
LAYOUT = BlockLayout(b"F" * 16, "float16", layers=2, kv_heads=3, head_dim=4)


def test_only_full_blocks_get_keys() -> None:
    assert len(block_keys(NS, list(range(11)))) == 2
    assert block_keys(NS, [1, 2, 3]) == []


def test_key_identifies_whole_prefix() -> None:
    a = block_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = block_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1], "same second block after a different first block must differ"
    assert a == block_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9])[:2]


def test_parent_continues_the_chain() -> None:
    toks = list(range(16))
    whole = block_keys(NS, toks)
    assert block_keys(NS, toks[8:], parent=whole[1]) == whole[2:]


def test_namespace_separates_tenants_and_models() -> None:
    toks = list(range(8))
    other_tenant = KeyNamespace("smollm2-135m", "float16", 4, tenant_salt="t2")
    other_model = KeyNamespace("llama", "float16", 4)
    assert block_keys(NS, toks) != block_keys(other_tenant, toks)
    assert block_keys(NS, toks) != block_keys(other_model, toks)


def test_bad_namespace_and_tokens_rejected() -> None:
    with pytest.raises(InvalidArgument, match="block_tokens"):
        KeyNamespace("m", "float16", 0)
    with pytest.raises(InvalidArgument, match="dtype"):
        KeyNamespace("m", "float64")
    with pytest.raises(InvalidArgument, match="token ids"):
        block_keys(NS, [-1, 2, 3, 4])


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_keys_are_deterministic_hex(tokens: list[int]) -> None:
    keys = block_keys(NS, tokens)
    assert keys == block_keys(NS, np.array(tokens, dtype=np.int64))
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)


def _payload(tokens: int, seed: int) -> np.ndarray:
    n = LAYOUT.payload_bytes(tokens) // 2
    return np.random.default_rng(seed).standard_normal(n).astype(np.float16)


@given(st.integers(1, 16), st.integers(0, 2**31))
def test_round_trip(tokens: int, seed: int) -> None:
    payload = _payload(tokens, seed)
    block = encode_block(LAYOUT, tokens, payload)
    assert len(block) == LAYOUT.block_bytes(tokens)
    header, view = decode_block(block, LAYOUT)
    assert header.tokens == tokens and header.layout == LAYOUT
    assert bytes(view) == payload.tobytes()


@settings(max_examples=300)
@given(st.integers(1, 4), st.data())
def test_any_corrupted_byte_is_detected(tokens: int, data: st.DataObject) -> None:
    block = bytearray(encode_block(LAYOUT, tokens, _payload(tokens, 7)))
    pos = data.draw(st.integers(0, len(block) - 1))
    flip = data.draw(st.integers(1, 255))
    block[pos] ^= flip
    with pytest.raises(IntegrityError):
        decode_block(block, LAYOUT)


def test_truncated_and_extended_blocks_rejected() -> None:
    block = encode_block(LAYOUT, 2, _payload(2, 1))
    with pytest.raises(IntegrityError, match="shorter"):
        decode_header(block[: HEADER_SIZE - 1])
    with pytest.raises(IntegrityError, match="bytes, header says"):
        decode_block(block[:-1])
    with pytest.raises(IntegrityError, match="bytes, header says"):
        decode_block(block + b"\x00")


def test_layout_mismatch_is_a_miss() -> None:
    block = encode_block(LAYOUT, 2, _payload(2, 1))
    other = BlockLayout(b"G" * 16, "float16", 2, 3, 4)
    with pytest.raises(IntegrityError, match="layout"):
        decode_block(block, other)


def test_wrong_payload_size_rejected_on_encode() -> None:
    with pytest.raises(InvalidArgument, match="need"):
        encode_block(LAYOUT, 2, b"\x00" * 3)
