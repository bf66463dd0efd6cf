"""Writing a fetched manifest into a directory: part files, one pool over every file's chunks.

Every missing chunk of every file goes into one bounded pool, so a directory of many small
files fetches as many chunks at once as one large file does. Each file is written into
`<file>.p2p-part` at its chunks' offsets (only verified bytes reach it: `Holders.read`
verifies before returning) and renamed into place after fsync when its last chunk lands.

Which chunk next and from whom is `holders.Holders.choose` (least-burdened holder, rarest chunk
first); ties go by an order shuffled by a seed of the fetcher's (its host), so fetchers that
start together ask the source for different chunks, keep what they fetched, and soon read from
each other instead of all queueing on the source for the same chunk.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mooncake_k8s.store.p2p.holders import Counters, Holders, Job
from mooncake_k8s.store.p2p.manifest import FileEntry, Manifest, chunk_digest

PART = ".p2p-part"


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
    """Fetch every missing chunk of `man` into `root`, `parallel` at a time, choosing each
    chunk and holder by `Holders.choose` (ties in an order shuffled by `seed`; None: manifest
    order); raises the first chunk's failure after every running read has stopped (part
    files stay, a rerun resumes)."""
    files: list[PartFile] = []
    try:
        for f in man.files:
            files.append(PartFile(man, f, root, holders.counters))
        jobs = [Job(f.entry.first + n, key(f.entry.first + n), man.chunks[f.entry.first + n],
                    (f, n)) for f in files for n in sorted(f.missing)]
        if seed is not None:
            random.Random(seed).shuffle(jobs)

        def write(job: Job, buf: memoryview) -> None:
            pf, n = job.owner
            pf.write(n, n * man.chunk_size, buf)
            if on_chunk is not None:
                on_chunk(job.index)

        _run(jobs, holders, write, parallel)
    finally:
        for pf in files:
            pf.close()


def _run(jobs: list[Job], holders: Holders, write: Callable[[Job, memoryview], None],
         parallel: int) -> None:
    """`parallel` workers each take the best (chunk, holder) `holders` offers, read it and
    write it; a worker finding every holder busy waits for a read to finish (and fresher
    replica lists). A failed read puts the chunk back with that holder refused for the round.
    The first error stops every worker (each finishes its current read) and is raised."""
    lock = threading.Lock()
    todo = list(jobs)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if errors or not todo:
                    return
                pending = list(todo)
            try:
                holders.refresh(pending)
                with lock:  # one choice at a time: two workers must not take the same chunk
                    picked = holders.choose(todo)
                    if picked is not None:
                        todo.remove(picked[0])
                if picked is None:
                    holders.wait()
                    continue
                job, loc = picked
                buf = memoryview(bytearray(job.chunk.size))
                if holders.read(job, loc, buf):
                    write(job, buf)
                    continue
                with lock:
                    todo.append(job)
            except BaseException as e:
                with lock:
                    errors.append(e)
                return

    with ThreadPoolExecutor(parallel, thread_name_prefix="p2p-get") as pool:
        for fut in [pool.submit(worker) for _ in range(parallel)]:
            fut.result()
    if errors:
        raise errors[0]
