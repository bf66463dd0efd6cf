"""Pure planning for the RDMA transport: which remote bytes, which key, which work request.

Nothing here touches pyverbs or a device, so every rule the data path relies on is unit-tested
on any machine, including the ones (all of ours so far) that have no RDMA hardware:

- `RegionMap` turns a (segment, offset, length) into the (remote address, rkey) to use, and
  refuses anything outside what the server registered. The server's NIC would refuse it too
  (a remote access error), but that error puts the queue pair into the error state and costs
  a reconnect; a local refusal keeps the connection and says which range was wrong.
- `plan_rounds` splits a batch into work requests that respect the path's largest message, the
  queue pair's outstanding-request limit and the size of the registered staging buffer.
- `negotiate` picks the path parameters both ends support.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mooncake_k8s.transfer.frames import (
    ST_OUT_OF_RANGE,
    ST_UNKNOWN_SEGMENT,
    RdmaEndpoint,
    RdmaRegion,
)
from mooncake_k8s.transfer.ops import TransferRejected

STAGE_ALIGN = 64
"""Pieces start on cache-line boundaries of the staging buffer (keeps DMA off shared lines)."""


class RegionMap:
    """The segments a server registered for RDMA, by name."""

    __slots__ = ("_regions",)

    def __init__(self, regions: Iterable[RdmaRegion]) -> None:
        self._regions: dict[str, RdmaRegion] = {}
        for r in regions:
            if r.name in self._regions:
                raise ValueError(f"RDMA region {r.name!r} listed twice")
            self._regions[r.name] = r

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, name: object) -> bool:
        return name in self._regions

    def locate(self, name: str, offset: int, length: int) -> tuple[int, int]:
        """(remote address, rkey) of `length` bytes at `offset` of segment `name`.

        Raises TransferRejected (unknown segment, or a range not wholly inside the region the
        server registered) before anything is posted, so the queue pair stays usable.
        """
        r = self._regions.get(name)
        if r is None:
            raise TransferRejected(
                f"segment {name!r} is not registered for RDMA at the peer", ST_UNKNOWN_SEGMENT
            )
        if offset < 0 or length < 0 or offset + length > r.length:
            raise TransferRejected(
                f"range [{offset}, {offset + length}) outside RDMA region {name!r} "
                f"of {r.length} bytes",
                ST_OUT_OF_RANGE,
            )
        return r.addr + offset, r.rkey


@dataclass(frozen=True, slots=True)
class Piece:
    """One work request: `length` bytes of caller op `op_index` (from `op_offset` in the
    caller's buffer) between `stage_offset` of the staging buffer and `remote_addr`."""

    op_index: int
    op_offset: int
    length: int
    remote_addr: int
    rkey: int
    stage_offset: int


def plan_rounds(
    targets: Sequence[tuple[int, int, int]],
    *,
    max_message: int,
    max_outstanding: int,
    stage_bytes: int,
    align: int = STAGE_ALIGN,
) -> list[list[Piece]]:
    """Split ops into rounds of work requests.

    `targets[i]` is op i's (length, remote address, rkey). Each piece is at most
    `min(max_message, stage_bytes)` bytes; a round holds at most `max_outstanding` pieces
    whose staging ranges (each starting on an `align` boundary) fit in `stage_bytes` without
    overlapping. A round is posted whole and its completions all reaped before the next, so
    the staging buffer is reused only once nothing can still be writing into it. Pieces keep
    each op's byte order (across rounds too), so a checksum can be streamed over them.
    Zero-length ops get no piece.
    """
    if max_message < 1 or max_outstanding < 1 or stage_bytes < 1 or align < 1:
        raise ValueError(
            f"need positive limits, got max_message={max_message}, "
            f"max_outstanding={max_outstanding}, stage_bytes={stage_bytes}, align={align}"
        )
    piece_max = min(max_message, stage_bytes)
    rounds: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for i, (length, addr, rkey) in enumerate(targets):
        if length < 0:
            raise ValueError(f"op {i} has negative length {length}")
        done = 0
        while done < length:
            n = min(piece_max, length - done)
            start = -(-used // align) * align
            if cur and (len(cur) >= max_outstanding or start + n > stage_bytes):
                rounds.append(cur)
                cur = []
                start = 0
            cur.append(Piece(i, done, n, addr + done, rkey, start))
            used = start + n
            done += n
    if cur:
        rounds.append(cur)
    return rounds


@dataclass(frozen=True, slots=True)
class PathParams:
    """What both ends of a queue pair support: MTU (verbs enum code, 1 = 256 B .. 5 = 4 KiB),
    the largest message, and outstanding RDMA READs (initiator depth)."""

    mtu: int
    max_message: int
    rd_atomic: int


def negotiate(local: RdmaEndpoint, remote: RdmaEndpoint) -> PathParams:
    """The lesser of each limit; at least one outstanding READ (the verbs minimum)."""
    return PathParams(
        mtu=min(local.mtu, remote.mtu),
        max_message=max(1, min(local.max_message, remote.max_message)),
        rd_atomic=max(1, min(local.rd_atomic, remote.rd_atomic)),
    )


def gid_to_str(gid: bytes) -> str:
    """16 raw bytes as pyverbs spells a GID: eight colon-separated groups of four hex digits."""
    if len(gid) != 16:
        raise ValueError(f"a GID has 16 bytes, got {len(gid)}")
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_from_str(text: str) -> bytes:
    """The inverse of `gid_to_str`."""
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {text!r}")
    return raw


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (what a memory registration needs)."""
    if not view.contiguous:
        raise ValueError("buffer is not contiguous")
    if view.nbytes == 0:
        raise ValueError("an empty buffer has no address to register")
    return int(np.frombuffer(view.cast("B") if view.format != "B" else view,
                             dtype=np.uint8).ctypes.data)

