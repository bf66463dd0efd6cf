"""Segments: named regions of shared memory (DRAM, a /dev/shm file) or of a file on SSD.

The owner creates the backing file, maps it and removes the file when it closes the segment;
peers on the same host map the same file (`Segment.open`) and copy with memcpy. The TCP server
serves the same mapping to remote peers.

The owner holds an exclusive `flock` on its file for as long as it lives (the kernel drops it
when the process dies, `kill -9` included). So a file nobody holds is a dead owner's leftover:
a restarted owner takes it over (`replace=True`), a harness reaps it (`reap_stale`), and a live
owner's file is never taken from it.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import glob
import hashlib
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass

from mooncake_k8s.common.errors import InvalidArgument, TransferError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mooncake-"
FILE_SUFFIX = ".seg"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")


class Tier(str, enum.Enum):  # noqa: UP042 (str() stays 'Tier.DRAM', as callers expect)
    DRAM = "dram"
    SSD = "ssd"


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"segment name must match [A-Za-z0-9._-]{{1,100}}, got {name!r}"
        )
    return name


def shm_path(name: str, tag: str = "") -> str:
    """/dev/shm/mooncake-[<tag>-]<name>. The tag (a short hex digest naming the cluster) keeps
    two clusters on one host, whose nodes may share ids, from taking each other's files."""
    if tag and (len(tag) > 16 or not all(c in "0123456789abcdef" for c in tag)):
        raise InvalidArgument(f"segment tag {tag!r} must be up to 16 lowercase hex digits")
    return os.path.join(SHM_DIR, SHM_PREFIX + (f"{tag}-" if tag else "") + validate_name(name))


def _is_shm_path(path: str, name: str) -> bool:
    base = os.path.basename(path)
    if os.path.dirname(os.path.normpath(path)) != SHM_DIR or not base.endswith(name):
        return False
    tag = base[len(SHM_PREFIX):-len(name)]
    return base.startswith(SHM_PREFIX) and (tag == "" or (
        tag.endswith("-") and 1 < len(tag) <= 17
        and all(c in "0123456789abcdef" for c in tag[:-1])))


def file_name(name: str) -> str:
    return SHM_PREFIX + validate_name(name) + FILE_SUFFIX


@dataclass(frozen=True)
class SegmentDesc:
    """What a peer needs to reach a segment: its name, tier, size and backing file."""

    name: str
    tier: Tier
    size: int
    path: str

    def __post_init__(self) -> None:
        validate_name(self.name)
        if not isinstance(self.size, int) or self.size < 0:
            raise InvalidArgument(f"segment size must be a non-negative int, got {self.size!r}")


class Segment:
    """A mapped segment. `buf` is a writable (unless opened read-only) 1-D byte view of it."""

    __slots__ = ("_closed", "_fd", "_keep", "_lock", "_lockfd", "_mmap", "_owner", "buf",
                 "desc")

    def __init__(self, desc: SegmentDesc, fd: int, *, owner: bool, writable: bool,
                 populate: bool = False, lockfd: int = -1, keep: bool = False) -> None:
        self.desc = desc
        self._owner = owner
        self._lockfd = lockfd  # holds the owner's flock until close
        self._keep = keep  # an SSD file that outlives the process (re-adopted on restart)
        self._closed = False
        self._lock = threading.Lock()
        self._fd = fd
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE: fault every page in now rather than on a put's first touch, which
        # cost a 64 KiB put ~90 us of page faults (allocating and zeroing the node's pages,
        # filling this process's page table).
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            self._mmap = mmap.mmap(fd, desc.size, flags=flags, prot=prot)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def create_shm(cls, name: str, size: int, *, replace: bool = False,
                   populate: bool = False, tag: str = "") -> Segment:
        """A new DRAM segment backed by /dev/shm/mooncake-<name> (created exclusively).

        `replace=True` first removes a file left by a previous owner that died (a restarted node).
        `populate=True` allocates all its memory now (a storage node's, so that puts do not pay
        for page faults), instead of as pages are first written.
        """
        path = shm_path(name, tag)
        return cls._create(SegmentDesc(name, Tier.DRAM, _check_size(size), path), replace,
                           populate)

    @classmethod
    def create_file(
        cls, name: str, directory: str, size: int, *, replace: bool = False
    ) -> Segment:
        """A new SSD-tier segment backed by a file in `directory`."""
        path = os.path.join(directory, file_name(name))
        return cls._create(SegmentDesc(name, Tier.SSD, _check_size(size), path), replace)

    @classmethod
    def adopt_file(cls, name: str, directory: str, size: int) -> tuple[Segment, bool]:
        """An SSD-tier segment whose file persists: the file a dead predecessor left is mapped
        as it is (its bytes kept), or a new one is created. The file stays when the segment is
        closed. Returns (segment, adopted). Refused (InvalidArgument) when a live process holds
        the file or its size is not `size`."""
        desc = SegmentDesc(name, Tier.SSD, _check_size(size),
                           os.path.join(directory, file_name(name)))
        fd = os.open(desc.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            lockfd = _lock_owner(fd, desc.path)
        except InvalidArgument:
            os.close(fd)
            raise
        try:
            have = os.fstat(fd).st_size
            if have not in (0, desc.size):
                raise InvalidArgument(
                    f"segment file {desc.path} is {have} bytes, this node's layout needs "
                    f"{desc.size}: another --ssd-size wrote it (remove it to start over)")
            if have == 0:
                os.ftruncate(fd, desc.size)
            return cls(desc, fd, owner=True, writable=True, lockfd=lockfd, keep=True), have > 0
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            os.close(lockfd)
            raise

    @classmethod
    def _create(cls, desc: SegmentDesc, replace: bool, populate: bool = False) -> Segment:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        if replace:
            _remove_if_dead(desc.path)
        try:
            fd = os.open(desc.path, flags, 0o600)
        except FileExistsError as e:
            raise InvalidArgument(f"segment file {desc.path} already exists") from e
        try:
            lockfd = _lock_owner(fd, desc.path)
            os.ftruncate(fd, desc.size)
        except BaseException:
            os.close(fd)
            os.unlink(desc.path)
            raise
        try:
            return cls(desc, fd, owner=True, writable=True, populate=populate, lockfd=lockfd)
        except OSError:
            os.unlink(desc.path)
            os.close(lockfd)
            raise

    @classmethod
    def open(cls, desc: SegmentDesc, writable: bool = True) -> Segment:
        """Map a peer's existing segment. Closing it only unmaps; the file stays.

        The path must name a segment file (`/dev/shm/mooncake-<name>` for DRAM,
        `.../mooncake-<name>.seg` for SSD), so a bad descriptor cannot map an arbitrary file.
        Raises TransferError when the file is missing, too small or cannot be mapped.
        """
        expected = shm_path(desc.name) if desc.tier == Tier.DRAM else None
        if expected is not None and not _is_shm_path(desc.path, validate_name(desc.name)):
            raise TransferError(f"segment {desc.name!r}: path {desc.path!r} is not {expected} "
                                "(or the same with a cluster tag)")
        if expected is None and os.path.basename(desc.path) != file_name(desc.name):
            raise TransferError(f"segment {desc.name!r}: path {desc.path!r} is not a segment file")
        if desc.size <= 0:
            raise TransferError(f"segment {desc.name!r} has size 0")
        flags = (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(desc.path, flags)
        except OSError as e:
            raise TransferError(f"cannot open segment {desc.name!r} at {desc.path}: {e}") from e
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise TransferError(f"cannot stat segment {desc.name!r}: {e}") from e
        if st.st_size < desc.size:
            os.close(fd)
            raise TransferError(
                f"segment {desc.name!r} file is {st.st_size} bytes, expected {desc.size}"
            )
        # A DRAM segment its node populated: fill this process's page table now too. One the
        # node left sparse stays sparse (populating here would allocate it all).
        populate = desc.tier == Tier.DRAM and st.st_blocks * 512 >= st.st_size
        try:
            return cls(desc, fd, owner=False, writable=writable, populate=populate)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot map segment {desc.name!r}: {e}") from e

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner(self) -> bool:
        return self._owner

    def close(self) -> None:
        """Unmap (and, for the owner, remove the file). Idempotent.

        If views of `buf` are still alive elsewhere the mapping cannot be unmapped now; it is
        then released when the last view goes away, and the file is still removed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(BufferError):
            self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            log.debug(
                "segment still has live views; unmapped when they are released",
                extra={"segment": self.desc.name},
            )
        if self._owner and not self._keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.desc.path)
        if self._lockfd >= 0:
            os.close(self._lockfd)  # after the unlink: a successor never sees it unheld
            self._lockfd = -1

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Segment({self.desc.name!r}, {self.desc.tier.value}, {self.desc.size}, {state})"


def _lock_owner(fd: int, path: str) -> int:
    """Take the owner's exclusive flock on the file behind `fd`; returns the (dup'ed) fd that
    holds it. InvalidArgument when a live process already holds it."""
    lockfd = os.dup(fd)
    try:
        fcntl.flock(lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(lockfd)
        raise InvalidArgument(
            f"segment file {path} is held by a live process (another owner with the same "
            "name is running)") from e
    return lockfd


def _remove_if_dead(path: str) -> bool:
    """Unlink a segment file no live process holds (its owner died); True if removed.
    InvalidArgument when a live owner holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return False
    try:
        os.close(_lock_owner(fd, path))
        os.unlink(path)  # still under no one's lock: its owner is gone
        log.warning("removed a segment file its dead owner left", extra={"path": path})
        return True
    finally:
        os.close(fd)


def cluster_tag(masters: list[str]) -> str:
    """The tag of a cluster's shared-memory files: a digest of its masters' addresses (as
    `host:port`, in the order the node was given them)."""
    return hashlib.sha256(",".join(masters).encode()).hexdigest()[:8]


def reap_stale(tag: str) -> list[str]:
    """Remove the /dev/shm segment files of cluster `tag` whose owners are dead (killed before
    they could remove them). Files a live owner holds stay. Returns the paths removed."""
    if not tag or len(tag) > 16 or not all(c in "0123456789abcdef" for c in tag):
        raise InvalidArgument(f"segment tag {tag!r} must be 1-16 lowercase hex digits")
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{tag}-*")):
        with contextlib.suppress(InvalidArgument, OSError):
            if _remove_if_dead(path):
                removed.append(path)
    return removed


def _check_size(size: int) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidArgument(f"segment size must be a positive int, got {size!r}")
    return size
