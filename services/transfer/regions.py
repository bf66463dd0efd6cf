"""Registered memory regions: a process's own buffers (an engine's KV cache) served over TCP.

Segments are shared-memory or SSD files that any process on the host can map. An engine's KV
cache is neither: it is memory the engine allocated itself (a torch tensor, pinned host memory).
For prefill→decode handoff the prefill side must write straight into the decode side's cache, at
addresses the decode side announces (SGLang's PD protocol sends raw buffer addresses), so the
decode process registers those buffers here and serves them with our `TransferServer`.

Each registered region is served as a segment named `mem-<base hex>`; one more segment,
`regions`, is the directory (version, count, then (base, size) pairs) a writer reads once per
peer to turn a raw destination address into (segment, offset). The server still checks every
range against the region it names, so a stale or torn directory read can fail a transfer but
can never write outside a registered region.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake_k8s.common.errors import InvalidArgument, TransferError
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import Peer, ReadOp, WriteOp
from mooncake_k8s.transfer.segments import SegmentDesc, Tier
from mooncake_k8s.transfer.tcp_server import TransferServer

DIRECTORY = "regions"
_HEAD = struct.Struct("<QI")
_ENTRY = struct.Struct("<QQ")
#: Room for 4,000 regions (a 60-layer model with K and V per layer and TP ranks uses ~250).
DIRECTORY_BYTES = _HEAD.size + 4000 * _ENTRY.size


def region_name(base: int) -> str:
    return f"mem-{base:x}"


def _view(ptr: int, size: int) -> memoryview:
    if ptr <= 0 or size <= 0:
        raise InvalidArgument(f"region ({ptr:#x}, {size}) must have a positive address and size")
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


@dataclass
class _Region:
    """Quacks like a `Segment` for `TransferServer` (it reads `desc` and `buf`)."""

    desc: SegmentDesc
    buf: memoryview


class RegionTable:
    """The regions this process serves, plus their directory segment."""

    def __init__(self, server: TransferServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}
        self._version = 0
        self._dir = _Region(SegmentDesc(DIRECTORY, Tier.DRAM, DIRECTORY_BYTES, ""),
                            memoryview(bytearray(DIRECTORY_BYTES)))
        server.add_segment(self._dir)  # type: ignore[arg-type]
        self._publish()

    def register(self, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        if len(ptrs) != len(sizes):
            raise InvalidArgument("ptrs and sizes differ in length")
        views = [_view(p, s) for p, s in zip(ptrs, sizes, strict=True)]
        with self._lock:
            if len(self._regions) + len(ptrs) > (DIRECTORY_BYTES - _HEAD.size) // _ENTRY.size:
                raise InvalidArgument("too many registered regions")
            for p, s, v in zip(ptrs, sizes, views, strict=True):
                self._server.add_segment(
                    _Region(SegmentDesc(region_name(p), Tier.DRAM, s, ""), v))  # type: ignore[arg-type]
                self._regions[p] = s
            self._publish()

    def deregister(self, ptrs: Sequence[int]) -> None:
        with self._lock:
            for p in ptrs:
                if self._regions.pop(p, None) is not None:
                    self._server.remove_segment(region_name(p))
            self._publish()

    def _publish(self) -> None:
        self._version += 1
        buf = self._dir.buf
        off = _HEAD.size
        for base, size in sorted(self._regions.items()):
            _ENTRY.pack_into(buf, off, base, size)
            off += _ENTRY.size
        _HEAD.pack_into(buf, 0, self._version, len(self._regions))


class RegionWriter:
    """Writes local memory into peers' registered regions, by raw destination address."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine
        self._dirs: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def _directory(self, peer: Peer, refresh: bool) -> list[tuple[int, int]]:
        with self._lock:
            known = self._dirs.get(peer.address)
        if known is not None and not refresh:
            return known
        head = bytearray(_HEAD.size)
        desc = SegmentDesc(DIRECTORY, Tier.DRAM, DIRECTORY_BYTES, "")
        self._engine.read(peer, [ReadOp(desc, 0, memoryview(head))])
        _, count = _HEAD.unpack(head)
        body = bytearray(count * _ENTRY.size)
        if count:
            self._engine.read(peer, [ReadOp(desc, _HEAD.size, memoryview(body))])
        entries = sorted(_ENTRY.iter_unpack(body))
        with self._lock:
            self._dirs[peer.address] = entries
        return entries

    @staticmethod
    def _find(entries: list[tuple[int, int]], addr: int, n: int) -> tuple[int, int] | None:
        lo, hi = 0, len(entries)
        while lo < hi:  # the last region starting at or below addr
            mid = (lo + hi) // 2
            if entries[mid][0] <= addr:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        base, size = entries[lo - 1]
        return (base, size) if addr + n <= base + size else None

    def write(self, peer: Peer, srcs: Sequence[int], dsts: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Copy each local `[src, src+len)` to the peer's `[dst, dst+len)`; raises
        TransferError (nothing is retried here: the caller's protocol decides)."""
        if not len(srcs) == len(dsts) == len(lengths):
            raise InvalidArgument("srcs, dsts and lengths differ in length")
        entries = self._directory(peer, refresh=False)
        ops: list[WriteOp] = []
        for attempt in (0, 1):
            ops.clear()
            missing = False
            for s, d, n in zip(srcs, dsts, lengths, strict=True):
                if n <= 0:
                    continue
                hit = self._find(entries, d, n)
                if hit is None:
                    missing = True
                    break
                base, size = hit
                ops.append(WriteOp(SegmentDesc(region_name(base), Tier.DRAM, size, ""),
                                   d - base, _view(s, n)))
            if not missing:
                break
            if attempt == 1:
                raise TransferError(f"address {d:#x}+{n} is in no region {peer.address} "
                                    "registered")
            entries = self._directory(peer, refresh=True)
        if ops:
            self._engine.write(peer, ops)

    def probe(self, peer: Peer) -> None:
        """Re-read the peer's directory: raises TransferError when it does not answer."""
        self._directory(peer, refresh=True)

    def forget(self, peer: Peer) -> None:
        with self._lock:
            self._dirs.pop(peer.address, None)
        self._engine.forget(peer)
