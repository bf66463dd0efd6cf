"""The P2P store's manifest: what a published directory is, chunk by chunk.

A published directory is a list of files (relative path, size, mode) each cut into chunks of at
most `chunk_size` bytes; a chunk never spans two files, so a fetcher writes each chunk at its
file's offset with no bookkeeping beyond the manifest. Every chunk carries its BLAKE3-128 digest:
a fetcher verifies every chunk against it before writing a byte, so a holder that serves altered
or torn bytes costs a refetch elsewhere, never a wrong file. The manifest itself is versioned
and carries the BLAKE2b digest of its canonical JSON (what names the chunks' keys), so a
manifest altered in the store is refused rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3

from mooncake_k8s.common.errors import InvalidArgument

VERSION = 2  # 2: chunk digests are BLAKE3 (1 was BLAKE2b)
DEFAULT_CHUNK = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


def chunk_digest(data: bytes | memoryview | bytearray) -> str:
    """The digest a chunk is verified against (BLAKE3, 128 bits, hex). BLAKE3 rather than
    BLAKE2b: every fetcher hashes every byte it receives, and at about 6 GB/s against 0.6 GB/s
    per core it takes the hashing from a third of a 2-core host's time to a few percent."""
    return blake3.blake3(data).hexdigest(16)


def check_name(name: str) -> str:
    """A published object's name: letters, digits, `._-/` (a model id such as
    `Qwen/Qwen3-0.6B` is one), no empty or `..` part."""
    if not isinstance(name, str) or not _NAME.match(name) or any(
            p in ("", ".", "..") for p in name.split("/")):
        raise InvalidArgument(
            f"p2p name {name!r} must be 1-200 characters of letters, digits and '._-/', "
            "with no empty, '.' or '..' part")
    return name


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """Relative to the published directory, '/'-separated."""
    size: int
    mode: int
    first: int
    """Index of the file's first chunk in `Manifest.chunks`."""
    count: int


@dataclass(frozen=True, slots=True)
class Chunk:
    size: int
    digest: str


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    chunk_size: int
    files: tuple[FileEntry, ...]
    chunks: tuple[Chunk, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def body(self) -> dict[str, object]:
        return {
            "version": VERSION, "name": self.name, "chunk_size": self.chunk_size,
            "files": [[f.path, f.size, f.mode, f.first, f.count] for f in self.files],
            "chunks": [[c.size, c.digest] for c in self.chunks],
        }

    @property
    def digest(self) -> str:
        """BLAKE2b-256 of the canonical JSON body: the manifest's identity."""
        return hashlib.blake2b(_canonical(self.body()), digest_size=32).hexdigest()

    def encode(self) -> bytes:
        """The stored form: the body and its digest."""
        return _canonical({"digest": self.digest, "manifest": self.body()})

    def chunks_of(self, f: FileEntry) -> Iterator[tuple[int, int, Chunk]]:
        """(chunk index, offset in the file, chunk) for each chunk of `f`."""
        for n in range(f.count):
            yield f.first + n, n * self.chunk_size, self.chunks[f.first + n]


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes | bytearray) -> Manifest:
    """Parse and verify a stored manifest; InvalidArgument says what is wrong with it."""
    try:
        env = json.loads(bytes(raw))
        body = env["manifest"]
        if body.get("version") != VERSION:
            raise InvalidArgument(f"p2p manifest version {body.get('version')!r} is not "
                                  f"{VERSION} (published by another release?)")
        files = tuple(FileEntry(str(p), int(s), int(m), int(a), int(n))
                      for p, s, m, a, n in body["files"])
        chunks = tuple(Chunk(int(s), str(d)) for s, d in body["chunks"])
        man = Manifest(check_name(str(body["name"])), int(body["chunk_size"]), files, chunks)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidArgument(f"p2p manifest is malformed: {e}") from e
    if man.digest != env.get("digest"):
        raise InvalidArgument("p2p manifest digest mismatch: the stored manifest was altered")
    _check_layout(man)
    return man


def _check_layout(man: Manifest) -> None:
    """Paths stay inside the directory and chunks tile each file exactly."""
    for f in man.files:
        parts = f.path.split("/")
        if f.path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise InvalidArgument(f"p2p manifest path {f.path!r} leaves the directory")
        want = -(-f.size // man.chunk_size)
        if f.count != want or f.first < 0 or f.first + f.count > len(man.chunks):
            raise InvalidArgument(f"p2p manifest chunks of {f.path!r} do not tile its size")
        for _, off, c in man.chunks_of(f):
            if c.size != min(man.chunk_size, f.size - off):
                raise InvalidArgument(f"p2p manifest chunk sizes of {f.path!r} are wrong")


def build(directory: str | os.PathLike[str], name: str,
          chunk_size: int = DEFAULT_CHUNK) -> Manifest:
    """Hash every regular file under `directory` (sorted; symlinks and specials refused) into
    a manifest. Reads each file once, chunk by chunk."""
    check_name(name)
    if chunk_size < 1:
        raise InvalidArgument(f"chunk_size must be >= 1, got {chunk_size}")
    root = Path(directory)
    if not root.is_dir():
        raise InvalidArgument(f"{str(root)!r} is not a directory")
    files: list[FileEntry] = []
    chunks: list[Chunk] = []
    for path in sorted(p for p in root.rglob("*")):
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            continue
        rel = path.relative_to(root).as_posix()
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{rel!r} is not a regular file (symlinks are not published)")
        first = len(chunks)
        with open(path, "rb") as fh:
            while block := fh.read(chunk_size):
                chunks.append(Chunk(len(block), chunk_digest(block)))
        size = sum(c.size for c in chunks[first:])
        files.append(FileEntry(rel, size, stat.S_IMODE(st.st_mode), first, len(chunks) - first))
    return Manifest(name, chunk_size, tuple(files), tuple(chunks))
