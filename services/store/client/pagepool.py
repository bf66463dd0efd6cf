"""Page pools: what engine adapters (SGLang's HiCache backend, vLLM's connector) use to move KV
pages between their own memory and our store.

A *page* is a list of raw memory regions `(ptr, nbytes)` in the caller's process: SGLang's host
KV pool hands out ~60 scattered regions per page (one per layer and K/V), a vLLM block is
similar. Engines own that memory and know it only by address, so the pool works on addresses
(viewed through ctypes) rather than on Python buffers.

Object format: a page is stored as ONE object, `PAGE_HEADER` (magic, version, payload length)
followed by the regions' bytes in order. The header records only the total payload length,
not the region layout, so a page written through the sidecar (one contiguous staging span) and
one written in-process (60 regions) are the same object; what makes two pages "the same KV"
(model, dtype, layout, TP shape) is in the key namespace the adapter builds. The store itself
checksums every object (xxh3-64 at put, verified at get); the header lets a reader also verify
that the object is a page of exactly the size it expects.

Failure contract, the reason for the shape of the API: a page that cannot be read (missing,
wrong size, bad header or checksum) is a *miss* (`False`) and the engine recomputes it; a read
never leaves a page's regions half-written, because bytes are verified in a scratch buffer
before they are scattered. Only a pool that is unreachable after the store client's retries
raises (`PoolUnavailable`), so the caller can tell "cold cache" from "no cache at all". Writes
never raise for a page: a failed save costs a later recompute, nothing more.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import (
    AuthError,
    BufferTooSmall,
    InvalidArgument,
    MooncakeError,
    ObjectExists,
    StoreError,
)
from mooncake_k8s.store.client.client import StoreClient

log = logging.getLogger(__name__)

Region = tuple[int, int]
"""(address, nbytes) of a memory region in this process."""
Page = Sequence[Region]

PAGE_MAGIC = b"MCPG"
PAGE_VERSION = 2
PAGE_HEADER = struct.Struct("<4sB3xQQ")
"""magic, version, 3 bytes padding, payload length (bytes after the header), xxh3-64 of the
payload as its writer computed it."""
HEADER_SIZE = PAGE_HEADER.size  # 24
MAX_PAGE_BYTES = 1 << 30
"""A page larger than this is refused as a caller bug (the store's default object limit)."""
CHUNK_BYTES = 64 << 20
"""Scratch memory per batch round trip: bounds the pool's extra memory whatever the batch."""


class PoolUnavailable(StoreError, ConnectionError):
    """The pool could not be reached at all (after retries); not a per-page miss."""


@runtime_checkable
class PagePool(Protocol):
    """Move pages between the caller's memory and the shared KV pool (module docstring)."""

    def prefix_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys of `keys` the pool holds."""
        ...

    def put_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Store each page under its key; True when stored (or already there)."""
        ...

    def get_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Fill each page from its key; False (regions untouched) for a miss."""
        ...

    def close(self) -> None: ...


# -- helpers shared with the sidecar --------------------------------------------------------


def region_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory at `ptr` (no copy). The caller vouches for the
    address: ctypes cannot check it, which is why pages are validated for shape first."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def check_pages(keys: Sequence[str], pages: Sequence[Page]) -> list[int]:
    """Validate the call's shape; returns each page's payload size.

    Raises InvalidArgument for a caller bug (lengths differ, a region that is not two
    non-negative ints with a non-zero address, an empty or oversized page): these are never
    per-page misses, since retrying the same call could not succeed.
    """
    if isinstance(keys, str):
        raise InvalidArgument("keys must be a sequence of strings, not one string")
    if len(keys) != len(pages):
        raise InvalidArgument(f"{len(keys)} keys but {len(pages)} pages")
    sizes = []
    for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"key {i} must be a non-empty string, got {key!r}")
        total = 0
        for region in page:
            try:
                ptr, n = region
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"page {i}: region {region!r} is not (ptr, nbytes)") from e
            if not _is_int(ptr) or not _is_int(n) or ptr <= 0 or n < 0:
                raise InvalidArgument(
                    f"page {i}: region ({ptr!r}, {n!r}) needs a positive int address and a "
                    "non-negative int size"
                )
            total += int(n)
        if total == 0:
            raise InvalidArgument(f"page {i} ({key!r}) has no bytes")
        if total > MAX_PAGE_BYTES:
            raise InvalidArgument(f"page {i} is {total} bytes, above {MAX_PAGE_BYTES}")
        sizes.append(total)
    return sizes


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def page_views(pages: Sequence[Page]) -> list[list[memoryview]]:
    """Each page's regions as byte views (empty regions dropped)."""
    return [[region_view(int(p), int(n)) for p, n in page if n] for page in pages]


def seal(obj: memoryview) -> None:
    """Write the header of `obj` (header space + payload already in place)."""
    payload = obj[HEADER_SIZE:]
    obj[:HEADER_SIZE] = PAGE_HEADER.pack(PAGE_MAGIC, PAGE_VERSION, len(payload),
                                         checksum(payload))


def header_ok(obj: memoryview, payload: int) -> bool:
    """True when `obj` (header + payload as read) is a page of exactly `payload` bytes whose
    payload is what its writer sealed. The store checksums objects too, but only as it got
    them: this catches a page that was wrong when put (a bug, a hostile writer)."""
    if len(obj) != HEADER_SIZE + payload:
        return False
    magic, version, n, digest = PAGE_HEADER.unpack_from(obj, 0)
    return bool(magic == PAGE_MAGIC and version == PAGE_VERSION and n == payload
                and digest == checksum(obj[HEADER_SIZE:]))


def _chunks(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive index ranges whose objects (header included) fit `limit` bytes together;
    a single larger page gets a range of its own."""
    out: list[range] = []
    start, used = 0, 0
    for i, s in enumerate(sizes):
        need = HEADER_SIZE + s
        if i > start and used + need > limit:
            out.append(range(start, i))
            start, used = i, 0
        used += need
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


# -- the in-process pool ----------------------------------------------------------------------


class DirectPagePool:
    """A `PagePool` over an in-process `StoreClient` (what a worker without a sidecar uses).

    `timeout_s` bounds each store call, the master's retries included; after it a put counts
    as failed and a read raises `PoolUnavailable`. `client` lets a caller share an existing
    store client (the sidecar does not; tests may); the pool then does not close it.
    """

    def __init__(
        self,
        master: str,
        token: str = "",
        transport: str = "auto",
        *,
        timeout_s: float = 5.0,
        client: StoreClient | None = None,
    ) -> None:
        self._own = client is None
        self.client = client or StoreClient(
            master, token, transport=transport, timeout_s=timeout_s,
            attempt_timeout_s=min(1.0, timeout_s),
        )

    # -- PagePool --------------------------------------------------------------------------

    def prefix_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            return self.client.prefix_len(list(keys))
        except (InvalidArgument, AuthError):
            raise
        except StoreError as e:
            raise PoolUnavailable(f"prefix lookup failed: {e}") from e

    def put_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        check_pages(keys, pages)
        return self.put_views(keys, page_views(pages))

    def get_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        check_pages(keys, pages)
        return self.get_views(keys, page_views(pages))

    def close(self) -> None:
        if self._own:
            self.client.close()

    def __enter__(self) -> DirectPagePool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the same over byte views (the sidecar's staging spans) -----------------------------

    def put_views(self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> list[bool]:
        """`put_pages` for pages given as byte views instead of raw regions."""
        sizes = [sum(len(v) for v in page) for page in pages]
        out = [False] * len(keys)
        for idx in _chunks(sizes, CHUNK_BYTES):
            scratch = bytearray(sum(HEADER_SIZE + sizes[i] for i in idx))
            objs: list[memoryview] = []
            pos = 0
            mv = memoryview(scratch)
            for i in idx:
                obj = mv[pos : pos + HEADER_SIZE + sizes[i]]
                at = HEADER_SIZE
                for v in pages[i]:
                    obj[at : at + len(v)] = v
                    at += len(v)
                seal(obj)
                objs.append(obj)
                pos += len(obj)
            try:
                results = self.client.batch_put([keys[i] for i in idx], objs)
            except MooncakeError as e:  # a malformed key, a dead master: never raise per page
                log.warning("page put failed", extra={"pages": len(idx), "error": str(e)})
                continue
            for i, err in zip(idx, results, strict=True):
                out[i] = err is None or isinstance(err, ObjectExists)
        return out

    def get_views(self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> list[bool]:
        """`get_pages` for pages given as byte views instead of raw regions."""
        sizes = [sum(len(v) for v in page) for page in pages]
        out = [False] * len(keys)
        for idx in _chunks(sizes, CHUNK_BYTES):
            scratch = bytearray(sum(HEADER_SIZE + sizes[i] for i in idx))
            mv = memoryview(scratch)
            objs: list[memoryview] = []
            pos = 0
            for i in idx:
                objs.append(mv[pos : pos + HEADER_SIZE + sizes[i]])
                pos += HEADER_SIZE + sizes[i]
            got = self._read([keys[i] for i in idx], objs)
            for i, obj, n in zip(idx, objs, got, strict=True):
                if n is None or not header_ok(obj[:n], sizes[i]):
                    continue
                at = HEADER_SIZE
                for v in pages[i]:  # verified: now (and only now) touch the caller's memory
                    v[:] = obj[at : at + len(v)]
                    at += len(v)
                out[i] = True
        return out

    def _read(self, keys: list[str], objs: list[memoryview]) -> list[int | None]:
        """Sizes read per key (None: miss). An object larger than expected is a miss, not an
        error for the whole batch."""
        try:
            try:
                return self.client.batch_get_into(keys, objs)
            except BufferTooSmall:
                pass
            got: list[int | None] = []
            for k, o in zip(keys, objs, strict=True):
                try:
                    got.append(self.client.batch_get_into([k], [o])[0])
                except BufferTooSmall:
                    got.append(None)
            return got
        except (InvalidArgument, AuthError):
            raise
        except StoreError as e:
            raise PoolUnavailable(f"page read failed: {e}") from e
