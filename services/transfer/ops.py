"""Operation and peer records shared by the transports and the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import TransferError
from mooncake_k8s.transfer.frames import ST_OUT_OF_RANGE
from mooncake_k8s.transfer.segments import SegmentDesc


@dataclass(frozen=True)
class Peer:
    """A process that owns segments: `address` is its TCP transfer server, `host_id` its
    shared-memory domain (equal to ours means its /dev/shm files can be mapped)."""

    node_id: str
    address: str
    host_id: str


@dataclass(slots=True)
class ReadOp:
    """Copy `len(dst)` bytes at `offset` of `segment` into `dst`."""

    segment: SegmentDesc
    offset: int
    dst: memoryview


@dataclass(slots=True)
class WriteOp:
    """Copy `src` into `segment` at `offset`."""

    segment: SegmentDesc
    offset: int
    src: memoryview


class TransferRejected(TransferError):
    """The peer (or a local check before sending) refused an operation: unknown segment or a
    range outside it. The connection stays usable. `code` is the wire status."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "transfer rejected"


def as_view(buf: Any, writable: bool) -> memoryview:
    """A flat byte view of a caller buffer (fast path for views that already are one)."""
    if (
        type(buf) is memoryview
        and buf.ndim == 1
        and buf.format == "B"
        and buf.c_contiguous
        and not (writable and buf.readonly)
    ):
        return buf
    return byte_view(buf, writable=writable)


def check_range(desc: SegmentDesc, offset: int, length: int) -> None:
    if offset < 0 or offset + length > desc.size:
        raise TransferRejected(
            f"range [{offset}, {offset + length}) outside segment {desc.name!r} "
            f"of {desc.size} bytes",
            ST_OUT_OF_RANGE,
        )
