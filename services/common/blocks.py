"""The KV block contract (DESIGN §3): chained block keys and the block header/payload codec.

Every component that names or reads a KV block goes through this module, so that a block
written by one prefill instance is found and trusted by any other.

Keys: ``key_i = blake2b(ns, key_{i-1}, tokens_i)`` (128 bit, hex). Chaining makes a key stand for
the whole prefix up to and including its block, so "longest cached prefix" is a walk over keys,
and the namespace (model, layout, dtype, block size, tenant salt) keeps incompatible or
other-tenant blocks apart. blake2b rather than a fast non-cryptographic hash: a crafted
collision would make one prompt read another's KV.

Payload: a 64-byte header, then one contiguous tensor laid out
``[layer, k|v, kv_head, token, head_dim]``. The header carries its own checksum and the
payload's, so any flipped byte anywhere is detected; readers turn that into a miss.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.common.errors import IntegrityError, InvalidArgument

LAYOUT_VERSION = 1
MAGIC = b"MCKV"
KEY_BYTES = 16

#: dtype name -> (wire code, bytes per element)
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "int8": (5, 1),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}

# magic, layout version, dtype code, model fingerprint, layers, kv heads, head dim, tokens,
# payload length, payload checksum, header checksum (over everything before it)
_HEADER = struct.Struct("<4sHH16sIIIIQQQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that must match for two blocks with equal tokens to be interchangeable."""

    model_fingerprint: str
    dtype: str
    block_tokens: int = BLOCK_TOKENS
    tenant_salt: str = ""
    layout_version: int = LAYOUT_VERSION
    kv_layout: str = ""
    """Which engine produced the KV ("" = the embedded engine; e.g. "vllm"): engines compute
    numerically different KV for the same tokens, so their blocks never stand in for each
    other even when the shapes agree."""

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise InvalidArgument(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")

    def digest(self) -> bytes:
        """A 16-byte digest of the namespace; fed into every block key."""
        parts: tuple[str, ...] = (
            self.model_fingerprint,
            str(self.layout_version),
            self.dtype,
            str(self.block_tokens),
            self.tenant_salt,
        )
        if self.kv_layout:  # the embedded engine's keys predate the field; keep them stable
            parts = (*parts, self.kv_layout)
        data = "\x00".join(parts).encode()
        return hashlib.blake2b(data, digest_size=KEY_BYTES, person=b"mooncake-ns").digest()


def engine_cache_salt(tenant: str) -> str | None:
    """What keeps tenants apart inside an engine's own prefix cache (vLLM's and SGLang's
    `cache_salt`); None for the shared namespace."""
    return hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest() if tenant else None


#: kv_layout tags starting with this name SGLang's pages: their keys are SGLang's own.
SGLANG_LAYOUT = "sglang"


def sglang_key_prefix(namespace: KeyNamespace) -> str:
    """Store-key prefix of an SGLang deployment's HiCache pages (rank 0; see engine.sglang).

    The tenant is not part of it: SGLang seeds its page-hash chain with the request's
    `cache_salt` instead, so tenants' pages differ in the hash itself."""
    return f"sg/{replace(namespace, tenant_salt='').digest().hex()}/"


def sglang_chain_seed(cache_salt: str | None) -> bytes | None:
    """SGLang's storage-chain seed for a request with this `cache_salt` (and no extra key)."""
    if cache_salt is None:
        return None
    d = hashlib.sha256(b"sglang-cache-namespace-v1")
    d.update(b"\x00")  # no extra_key
    salt = cache_salt.encode()
    d.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    return d.digest()


def _packed(token_ids: Sequence[int] | np.ndarray) -> tuple[bytes, int]:
    """Little-endian uint32 token ids, and how many."""
    if type(token_ids) in (list, tuple) and _NATIVE_U32:
        # A list of Python ints (every tokenizer's output) packs about 5x faster through
        # array than through numpy, and array checks the same range. Anything it refuses
        # (floats, nested lists, out-of-range ids) takes numpy's path below, which says why.
        try:
            return array("I", token_ids).tobytes(), len(token_ids)
        except (TypeError, OverflowError, ValueError):
            pass
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise InvalidArgument("token_ids must be one-dimensional")
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise InvalidArgument("token ids must be in [0, 2**32)")
    return tokens.astype("<u4").tobytes(), int(tokens.size)


_NATIVE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"


def _sglang_keys(namespace: KeyNamespace, token_ids: Sequence[int] | np.ndarray) -> list[str]:
    """SGLang's page keys (SHA-256 chained over little-endian uint32 token ids, seeded per
    tenant), under our prefix: the same names SGLang's HiCache backend stores pages under, so
    the Conductor's index sees SGLang's pool pages as it sees any block."""
    packed, n = _packed(token_ids)
    prefix = sglang_key_prefix(namespace)
    prev = sglang_chain_seed(engine_cache_salt(namespace.tenant_salt))
    step = namespace.block_tokens * 4
    keys: list[str] = []
    for i in range(n // namespace.block_tokens):
        h = hashlib.sha256(prev) if prev is not None else hashlib.sha256()
        h.update(packed[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prefix + prev.hex())
    return keys


def block_keys(
    namespace: KeyNamespace, token_ids: Sequence[int] | np.ndarray, parent: str | None = None
) -> list[str]:
    """Keys of every *full* block of `token_ids` (a trailing partial block has no key).

    `parent` continues a chain: the key of the block just before `token_ids[0]`.
    """
    if namespace.kv_layout.startswith(SGLANG_LAYOUT):
        if parent is not None:
            raise InvalidArgument("SGLang page keys do not continue a chain from a parent")
        return _sglang_keys(namespace, token_ids)
    packed, _ = _packed(token_ids)
    step = namespace.block_tokens * 4
    # The namespace is the same first input to every block's hash: absorb it once and copy
    # the hasher's state per block (about half the cost of a fresh, parameterised hasher).
    seeded = hashlib.blake2b(namespace.digest(), digest_size=KEY_BYTES, person=b"mooncake-blk")
    prev = bytes.fromhex(parent) if parent else b"\x00" * KEY_BYTES
    digests: list[bytes] = []
    for start in range(0, len(packed) - step + 1, step):
        h = seeded.copy()
        h.update(prev + packed[start : start + step])
        prev = h.digest()
        digests.append(prev)
    return [d.hex() for d in digests]


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block's KV tensor; `payload_bytes` is what the header promises."""

    model_fingerprint: bytes
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if len(self.model_fingerprint) != 16:
            raise InvalidArgument("model_fingerprint must be 16 bytes")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1")

    def payload_bytes(self, tokens: int) -> int:
        elem = DTYPES[self.dtype][1]
        return self.layers * 2 * self.kv_heads * tokens * self.head_dim * elem

    def block_bytes(self, tokens: int) -> int:
        return HEADER_SIZE + self.payload_bytes(tokens)


@dataclass(frozen=True)
class BlockHeader:
    layout: BlockLayout
    tokens: int
    payload_len: int
    payload_checksum: int


def encode_header(layout: BlockLayout, tokens: int, payload: Any) -> bytes:
    """The 64-byte header for `payload` (which is hashed, not copied)."""
    view = byte_view(payload)
    expected = layout.payload_bytes(tokens)
    if len(view) != expected:
        raise InvalidArgument(
            f"payload is {len(view)} bytes; layout and {tokens} tokens need {expected}"
        )
    body = _HEADER.pack(
        MAGIC,
        LAYOUT_VERSION,
        DTYPES[layout.dtype][0],
        layout.model_fingerprint,
        layout.layers,
        layout.kv_heads,
        layout.head_dim,
        tokens,
        len(view),
        checksum(view),
        0,
    )
    return body[:-8] + struct.pack("<Q", checksum(body[:-8]))


def encode_block(layout: BlockLayout, tokens: int, payload: Any) -> bytes:
    """Header followed by the payload, as one bytes object."""
    return encode_header(layout, tokens, payload) + bytes(byte_view(payload))


def decode_header(data: Any) -> BlockHeader:
    """Parse and check the header at the start of `data` (the payload is not checked here)."""
    view = byte_view(data)
    if len(view) < HEADER_SIZE:
        raise IntegrityError(
            f"block is {len(view)} bytes, shorter than its {HEADER_SIZE}-byte header"
        )
    raw = bytes(view[:HEADER_SIZE])
    fields = _HEADER.unpack(raw)
    magic, version, dtype_code, fp, layers, heads, head_dim, tokens, plen, pcsum, hcsum = fields
    if magic != MAGIC:
        raise IntegrityError("bad block magic")
    if checksum(raw[:-8]) != hcsum:
        raise IntegrityError("block header checksum mismatch")
    if version != LAYOUT_VERSION:
        raise IntegrityError(f"block layout version {version}, expected {LAYOUT_VERSION}")
    if dtype_code not in _DTYPE_BY_CODE:
        raise IntegrityError(f"unknown dtype code {dtype_code}")
    try:
        layout = BlockLayout(fp, _DTYPE_BY_CODE[dtype_code], layers, heads, head_dim)
    except InvalidArgument as e:
        raise IntegrityError(f"bad block header: {e}") from e
    if layout.payload_bytes(tokens) != plen:
        raise IntegrityError("block header payload length disagrees with its shape")
    return BlockHeader(layout, tokens, plen, pcsum)


def decode_block(
    data: Any, expected: BlockLayout | None = None, *, check_payload: bool = True
) -> tuple[BlockHeader, memoryview]:
    """Verify a whole block and return its header and a view of its payload.

    Raises IntegrityError on any mismatch: wrong magic, version, shape, length or checksum,
    or a layout other than `expected`. Callers treat that as a cache miss.
    `check_payload=False` skips hashing the payload, for bytes that were just verified against
    a checksum covering the whole object (the store's, checked during the copy out of it): the
    header (with its own checksum), layout and lengths are still checked.
    """
    view = byte_view(data)
    header = decode_header(view)
    if expected is not None and header.layout != expected:
        raise IntegrityError("block layout does not match the expected model layout")
    if len(view) != HEADER_SIZE + header.payload_len:
        raise IntegrityError(
            f"block is {len(view)} bytes, header says {HEADER_SIZE + header.payload_len}"
        )
    payload = view[HEADER_SIZE:]
    if check_payload and checksum(payload) != header.payload_checksum:
        raise IntegrityError("block payload checksum mismatch")
    return header, payload
