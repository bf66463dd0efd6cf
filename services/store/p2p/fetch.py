"""Writing a fetched manifest into a directory: part files, one pool over every file's chunks.

Every missing chunk of every file goes into one bounded pool, so a directory of many small
files fetches as many chunks at once as one large file does. Each file is written into
`<file>.p2p-part` at its chunks' offsets (only verified bytes reach it: `Holders.fetch`
verifies before returning) and renamed into place after fsync when its last chunk lands.

The order chunks are fetched in is shuffled by a seed of the fetcher's (its host): fetchers
that start together then ask for different chunks first, each keeps what it fetched, and they
soon read from each other instead of all queueing on the source for the same chunk.
"""

from __future__ import annotations

import os
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mooncake_k8s.store.p2p.holders import Counters, Holders
from mooncake_k8s.store.p2p.manifest import FileEntry, Manifest, chunk_digest

PART = ".p2p-part"
LOOKAHEAD = 4  # chunks a worker passes over (every holder busy) before it waits for one


class PartFile:
    """One file being fetched: its part file's descriptor and the chunks still to write."""

    def __init__(self, man: Manifest, f: FileEntry, root: Path, counters: Counters) -> None:
        self.entry = f
        self.final = root / f.path
        self.part = self.final.with_name(self.final.name + PART)
        self.fd = -1
        self.lock = threading.Lock()
        self.missing: set[int] = set()
        exists = self.final.is_file()
        have = verified(man, f, self.final) if exists else set()
        if exists and len(have) == f.count and self.final.stat().st_size == f.size:
            counters.add(reused=len(have))
            os.chmod(self.final, f.mode)
            return
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if have and not self.part.exists():
            os.replace(self.final, self.part)  # an altered file: repair its bad chunks only
        elif self.part.is_file():
            have = verified(man, f, self.part)
        else:
            have = set()
        counters.add(reused=len(have))
        self.missing = set(range(f.count)) - have
        self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, f.size)
        if not self.missing:
            self.finish()

    def write(self, n: int, offset: int, data: memoryview) -> None:
        """Write chunk `n` of the file; the last one finishes the file."""
        with self.lock:
            os.pwrite(self.fd, data, offset)
            self.missing.discard(n)
            if not self.missing:
                self.finish()

    def finish(self) -> None:
        os.fsync(self.fd)
        self.close()
        os.chmod(self.part, self.entry.mode)
        os.replace(self.part, self.final)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def verified(man: Manifest, f: FileEntry, path: Path) -> set[int]:
    """Chunks of `f` (by position in the file) that `path` already holds, verified."""
    if path.stat().st_size != f.size:
        return set()
    good = set()
    with open(path, "rb") as fh:
        for n, (_, off, chunk) in enumerate(man.chunks_of(f)):
            fh.seek(off)
            if chunk_digest(fh.read(chunk.size)) == chunk.digest:
                good.add(n)
    return good


def fetch_all(man: Manifest, root: Path, holders: Holders, key: Callable[[int], str], *,
              parallel: int, seed: int | None,
              on_chunk: Callable[[int], None] | None = None) -> None:
    """Fetch every missing chunk of `man` into `root`, `parallel` at a time, in an order
    shuffled by `seed` (None: manifest order); raises the first chunk's failure after every
    running fetch has stopped (part files stay, a rerun resumes)."""
    files: list[PartFile] = []
    try:
        for f in man.files:
            files.append(PartFile(man, f, root, holders.counters))
        todo = [(pf, n) for pf in files for n in sorted(pf.missing)]
        if seed is not None:
            random.Random(seed).shuffle(todo)

        def one(pf: PartFile, n: int, wait: bool) -> bool:
            index = pf.entry.first + n
            chunk = man.chunks[index]
            buf = memoryview(bytearray(chunk.size))
            if not holders.fetch(key(index), index, chunk, buf, wait=wait):
                return False
            pf.write(n, n * man.chunk_size, buf)
            if on_chunk is not None:
                on_chunk(index)
            return True

        _run_queue(deque(todo), one, parallel)
    finally:
        for pf in files:
            pf.close()


def _run_queue(todo: deque[tuple[PartFile, int]],
               one: Callable[[PartFile, int, bool], bool], parallel: int) -> None:
    """`parallel` workers take chunks off `todo`. A chunk whose every holder is busy with
    this fetcher's reads goes to the back and the worker tries another (one a peer may hold
    by now); after LOOKAHEAD such skips in a row it waits for a holder instead. The first
    failure stops every worker (each finishes its current chunk) and is raised."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        skipped = 0
        while True:
            with lock:
                if errors or not todo:
                    return
                pf, n = todo.popleft()
                wait = skipped >= min(LOOKAHEAD, len(todo))
            try:
                if one(pf, n, wait):
                    skipped = 0
                    continue
            except BaseException as e:
                with lock:
                    errors.append(e)
                return
            with lock:
                todo.append((pf, n))
            skipped += 1

    with ThreadPoolExecutor(parallel, thread_name_prefix="p2p-get") as pool:
        for fut in [pool.submit(worker) for _ in range(parallel)]:
            fut.result()
    if errors:
        raise errors[0]
