"""The SSD tier's persistent state: a directory header and a journal per segment.

The segment file holds only object bytes, so on its own it cannot say what lives where. The
node therefore appends one journal line per COMMITTED / FREED the master sends for an SSD
segment (key, offset, size, checksum), each line with its own CRC, written straight to the file
(no buffering in the process, so `kill -9` loses nothing the kernel was given). A restarted node
replays the journal, keeps every object whose bytes still match their xxh3 checksum, drops the
rest (a torn line, bytes altered or never fully written), rewrites the journal with only what it
kept, and reports those objects to the master in its inventory (the master restores them from
it as it does after its own restart).

`mooncake-ssd.json` in the directory names the node and the layout (segment names and sizes);
a directory written by another node id or another layout is refused with a clear message, so
two nodes never serve each other's bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from dataclasses import dataclass

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.transfer import Segment

log = logging.getLogger(__name__)

HEADER = "mooncake-ssd.json"
FORMAT = 1


@dataclass(frozen=True)
class Record:
    key: str
    offset: int
    size: int
    checksum: int


def check_header(directory: str, node_id: str, layout: dict[str, int]) -> None:
    """Write the directory's header, or check that the one there is this node's and layout's.
    InvalidArgument (naming the owner or the difference) when it is not."""
    path = os.path.join(directory, HEADER)
    want = {"format": FORMAT, "node_id": node_id, "segments": layout}
    try:
        with open(path, encoding="utf-8") as f:
            have = json.load(f)
    except FileNotFoundError:
        _write_atomic(path, json.dumps(want, sort_keys=True).encode())
        return
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"SSD directory {directory}: unreadable header {path}: {e} "
                              "(remove the directory's files to start over)") from e
    if not isinstance(have, dict) or have.get("format") != FORMAT:
        raise InvalidArgument(f"SSD directory {directory}: header {path} has an unknown format "
                              f"{have.get('format') if isinstance(have, dict) else have!r}")
    if have.get("node_id") != node_id:
        raise InvalidArgument(
            f"SSD directory {directory} belongs to node {have.get('node_id')!r}, not "
            f"{node_id!r}: give each node its own --ssd-dir (or remove this one's files)")
    if have.get("segments") != layout:
        raise InvalidArgument(
            f"SSD directory {directory} was written with layout {have.get('segments')}, this "
            f"node has {layout}: keep the same --ssd-size (or remove the directory's files)")


class Journal:
    """The append-only record of what one SSD segment holds (see the module doc)."""

    def __init__(self, directory: str, segment: str) -> None:
        self.path = os.path.join(directory, f"mooncake-{segment}.journal")
        self.segment = segment
        self._fd = -1
        self.lines = 0  # lines in the file now (compacted when mostly superseded)

    def recover(self, seg: Segment) -> tuple[list[Record], int]:
        """Replay the journal against the segment's bytes: (verified records, dropped count).
        Rewrites the journal to hold exactly the verified ones and opens it for appends."""
        live: dict[int, Record] = {}
        torn = 0
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            for raw in f:
                rec = _parse(raw)
                if rec is None:
                    torn += 1
                elif isinstance(rec, Record):
                    live[rec.offset] = rec
                else:
                    live.pop(rec, None)
        kept = [r for r in sorted(live.values(), key=lambda r: r.offset) if _intact(seg, r)]
        dropped = torn + len(live) - len(kept)
        for r in live.values():
            if r not in kept:
                log.warning("SSD object dropped: its bytes do not match its checksum",
                            extra={"key": r.key, "segment": self.segment, "offset": r.offset})
        self.rewrite(kept)
        return kept, dropped

    def rewrite(self, live: list[Record]) -> None:
        """Replace the journal by one line per live record (atomically: a crash leaves the old
        or the new file, both complete) and append to the new one."""
        _write_atomic(self.path, b"".join(_line(r) for r in live))
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
        self.lines = len(live)

    def should_compact(self, live: int) -> bool:
        """Whether most lines are superseded (freed or overwritten objects)."""
        return self.lines > 2 * live + 4096

    def committed(self, rec: Record) -> None:
        self._append(_line(rec))

    def freed(self, offset: int) -> None:
        self._append(_seal(f"F {offset}".encode()))

    def _append(self, line: bytes) -> None:
        if self._fd >= 0:
            os.write(self._fd, line)
            self.lines += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _seal(body: bytes) -> bytes:
    return body + b" %08x\n" % zlib.crc32(body)


def _line(r: Record) -> bytes:
    return _seal(f"C {r.offset} {r.size} {r.checksum} {r.key.encode().hex()}".encode())


def _parse(raw: bytes) -> Record | int | None:
    """A COMMITTED line's Record, a FREED line's offset, or None for a torn/altered line."""
    body, _, crc = raw.rstrip(b"\n").rpartition(b" ")
    if not raw.endswith(b"\n") or crc != b"%08x" % zlib.crc32(body):
        return None
    parts = body.decode("ascii", "replace").split(" ")
    try:
        if parts[0] == "F" and len(parts) == 2:
            return int(parts[1])
        if parts[0] == "C" and len(parts) == 5:
            return Record(bytes.fromhex(parts[4]).decode(), int(parts[1]), int(parts[2]),
                          int(parts[3]))
    except ValueError:
        pass
    return None


def _intact(seg: Segment, r: Record) -> bool:
    if r.offset < 0 or r.size < 1 or r.offset + r.size > seg.desc.size:
        return False
    return checksum(seg.buf[r.offset:r.offset + r.size]) == r.checksum


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
