"""Block keys, checked against a plain reading of the KV block contract (DESIGN §3).

`block_keys` packs tokens and seeds its hashers in bulk for speed (the Conductor hashes every
prompt before it schedules it); the reference below does the contract one token and one block
at a time, so a shortcut that changed a single key would show here.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import numpy as np
import pytest

from mooncake_k8s.common.blocks import KEY_BYTES, KeyNamespace, block_keys
from mooncake_k8s.common.errors import InvalidArgument


def reference_keys(ns: KeyNamespace, tokens: list[int], parent: str | None = None) -> list[str]:
    """key_i = blake2b(person="mooncake-blk", 16 bytes)(ns digest, key_{i-1}, tokens_i as
    little-endian uint32); key_{-1} is the parent's, or 16 zero bytes."""
    prev = bytes.fromhex(parent) if parent else bytes(KEY_BYTES)
    out = []
    bt = ns.block_tokens
    for i in range(len(tokens) // bt):
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"mooncake-blk")
        h.update(ns.digest())
        h.update(prev)
        for t in tokens[i * bt : (i + 1) * bt]:
            h.update(struct.pack("<I", t))
        prev = h.digest()
        out.append(prev.hex())
    return out


@pytest.mark.parametrize("block_tokens", [1, 16, 64])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 8192 + 17])
def test_keys_match_the_reference(block_tokens: int, n: int) -> None:
    rng = random.Random(n * 100 + block_tokens)
    ns = KeyNamespace("ab" * 16, "bfloat16", block_tokens, tenant_salt="t1")
    toks = [rng.randrange(2**32) for _ in range(n)]
    want = reference_keys(ns, toks)
    assert block_keys(ns, toks) == want
    assert block_keys(ns, tuple(toks)) == want
    assert block_keys(ns, np.array(toks, dtype=np.int64)) == want
    assert block_keys(ns, np.array(toks, dtype=np.uint32)) == want


def test_chained_continuation_and_namespaces_match_the_reference() -> None:
    rng = random.Random(7)
    toks = [rng.randrange(50_000) for _ in range(64 * 9 + 5)]
    for ns in (KeyNamespace("cd" * 16, "float16"), KeyNamespace("cd" * 16, "float16",
                                                                  kv_layout="vllm")):
        whole = block_keys(ns, toks)
        assert whole == reference_keys(ns, toks)
        tail = block_keys(ns, toks[64 * 4 :], parent=whole[3])
        assert tail == whole[4:] == reference_keys(ns, toks[64 * 4 :], parent=whole[3])


def test_edge_token_ids_and_refusals() -> None:
    ns = KeyNamespace("ab" * 16, "bfloat16", 2)
    edge: list[Any] = [0, 2**32 - 1, True, np.int64(7), np.uint32(9), 2**31]
    assert block_keys(ns, edge) == reference_keys(ns, [int(t) for t in edge])
    bads: list[Any] = [[1, -1], [2**32, 0], [[1, 2], [3, 4]]]
    for bad in bads:
        with pytest.raises(InvalidArgument):
            block_keys(ns, bad)
