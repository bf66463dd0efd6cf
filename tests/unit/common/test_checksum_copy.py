"""`copy_with_checksum` copies every byte and hashes exactly what it copied, whatever the size
relative to its chunk (the same-host get relies on it to detect an altered object)."""

from __future__ import annotations

import random

import pytest

from mooncake_k8s.common.checksum import COPY_CHUNK, checksum, copy_with_checksum


def _bytes(n: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(n))


@pytest.mark.parametrize("n", [0, 1, 4095, COPY_CHUNK - 1, COPY_CHUNK, COPY_CHUNK + 1,
                               3 * COPY_CHUNK + 17])
def test_copy_is_exact_and_hash_is_the_whole_objects(n: int) -> None:
    src = _bytes(n, n)
    dst = bytearray(n + 8)  # bytes past the object stay untouched
    h = copy_with_checksum(memoryview(dst)[:n], memoryview(src))
    assert dst[:n] == src and not any(dst[n:])
    assert h == checksum(bytes(src))


def test_a_byte_altered_in_any_chunk_changes_the_hash() -> None:
    n = 2 * COPY_CHUNK + 5
    src = _bytes(n, 1)
    dst = bytearray(n)
    want = copy_with_checksum(memoryview(dst), memoryview(src))
    for at in (0, COPY_CHUNK - 1, COPY_CHUNK, n - 1):
        bad = bytearray(src)
        bad[at] ^= 1
        assert copy_with_checksum(memoryview(dst), memoryview(bad)) != want
