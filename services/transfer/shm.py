"""Same-host transport: map the peer's segment file and memcpy.

Mappings are cached by path. Each call re-checks the file's identity (device, inode) once per
segment, so a peer that restarted and re-created its segment under the same name is remapped
instead of silently reading or writing the old, unlinked memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from mooncake_k8s.common.checksum import copy_with_checksum
from mooncake_k8s.common.errors import TransferError
from mooncake_k8s.transfer.ops import ReadOp, WriteOp, as_view, check_range
from mooncake_k8s.transfer.segments import Segment, SegmentDesc


class ShmMapError(TransferError):
    """A peer segment could not be mapped (not on this host, missing, no permission)."""


class ShmTransport:
    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], Segment]] = {}
        self._lock = threading.Lock()

    def _segment(self, desc: SegmentDesc) -> Segment:
        try:
            st = os.stat(desc.path)
        except OSError as e:
            raise ShmMapError(f"cannot map segment {desc.name!r}: {e}") from e
        ident = (st.st_dev, st.st_ino)
        with self._lock:
            cached = self._maps.get(desc.path)
            if cached is not None:
                if cached[0] == ident and cached[1].desc.size >= desc.size:
                    return cached[1]
                del self._maps[desc.path]
                cached[1].close()
            try:
                seg = Segment.open(desc, writable=True)
            except TransferError as e:
                raise ShmMapError(str(e)) from e
            self._maps[desc.path] = (ident, seg)
            return seg

    def prepare(self, descs: Iterable[SegmentDesc]) -> dict[str, Segment]:
        """Map (or re-validate) every distinct segment; raises ShmMapError."""
        out: dict[str, Segment] = {}
        for d in descs:
            if d.path not in out:
                out[d.path] = self._segment(d)
        return out

    def read(self, ops: Sequence[ReadOp], with_checksum: bool = False) -> list[int] | None:
        return self._copy([(op.segment, op.offset, op.dst) for op in ops], True, with_checksum)

    def write(self, ops: Sequence[WriteOp], with_checksum: bool = False) -> list[int] | None:
        return self._copy([(op.segment, op.offset, op.src) for op in ops], False, with_checksum)

    def _copy(
        self, ops: Sequence[tuple[SegmentDesc, int, Any]], into_caller: bool, with_checksum: bool
    ) -> list[int] | None:
        """One memcpy per op between a caller buffer and mapped segment memory; the direction
        is the only difference between a read and a write."""
        segs = self.prepare(seg for seg, _, _ in ops)
        sums: list[int] | None = [] if with_checksum else None
        for seg, offset, buf in ops:
            view = as_view(buf, into_caller)
            n = len(view)
            check_range(seg, offset, n)
            mapped = segs[seg.path].buf[offset : offset + n]
            dst, src = (view, mapped) if into_caller else (mapped, view)
            if sums is None:
                dst[:] = src
            else:
                sums.append(copy_with_checksum(dst, src))
        return sums

    def unmap(self, paths: Iterable[str]) -> None:
        with self._lock:
            for p in paths:
                cached = self._maps.pop(p, None)
                if cached is not None:
                    cached[1].close()

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for _, seg in maps.values():
            seg.close()
