"""Choosing which chunk to fetch next and from whom: the P2P store's data path.

Who holds what is the store master's replica list: a chunk is a store object, the publisher's
storage node holds its first replica and every fetcher adds one on its own host's node
(`ReplicaStart`/`ReplicaEnd`, the client's `keep_replica`). So there is no second tracker to
keep consistent with the bytes: a holder that dies drops out of the list when the master
notices, and a replica the master lists is one a node really has.

The choice is what makes N fetchers cost the source about one copy instead of N:
- **Least-burdened holder first.** Among a chunk's holders, this host's own first, then the
  one that holds the fewest of the chunks this fetcher still needs. The source holds all of
  them, so it is asked last; a peer that has just kept a few is asked first. No holder is
  special-cased, so a source that dies changes nothing here.
- **Rarest chunk first** when the only free holder is a busy one (the source): the chunk with
  the fewest holders, so what the source sends is what no peer has yet. Ties go by an order
  shuffled per fetcher, so fetchers that start together ask the source for different chunks.
- **One read in flight per holder host** (`PER_HOLDER`): without it, a fetcher with `parallel`
  threads asks the only holder at the start (the source) for `parallel` chunks at once, every
  fetcher does the same, and by the time any holds a chunk to serve, the source has sent nearly
  everything to everyone.

The replica lists are re-read from the master in one batch at most every `REFRESH_S` (peers
keep chunks as they go, so the lists change by the millisecond); each chunk is verified against
the manifest's digest rather than trusting the transport.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.common.errors import StoreError, TransferError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.p2p.manifest import Chunk, chunk_digest
from mooncake_k8s.store.wire import Location, ObjectInfo

log = logging.getLogger(__name__)

PER_HOLDER = 1
REFRESH_S = 0.05  # oldest replica lists a choice may use
ROUNDS = 3  # times every holder of a chunk is asked before the fetch fails


@dataclass
class Counters:
    """What one fetch did; `by_host` counts chunks read from each holder's host."""

    fetched: int = 0
    reused: int = 0
    corrupt: int = 0
    failed_reads: int = 0
    kept: int = 0
    by_host: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def read_from(self, host: str) -> None:
        with self.lock:
            self.fetched += 1
            self.by_host[host] = self.by_host.get(host, 0) + 1


@dataclass(eq=False)
class Job:
    """One chunk to fetch. `refused` holds the segments that failed it this round; `why` the
    last failure (for the error when every round failed); `owner` is the caller's (the part
    file the chunk goes into)."""

    index: int
    key: str
    chunk: Chunk
    owner: Any = None
    refused: set[str] = field(default_factory=set)
    rounds: int = 0
    why: str = "not published"
    info: ObjectInfo | None = None  # the replica list it was chosen from


class Holders:
    """Chunk choices and reads for one fetcher. `keep_on` is a segment (this host's, when it
    has one) to add a replica of each fetched chunk to ("" keeps nothing), so the fetcher
    serves what it fetched. Thread-safe: every fetch thread calls `choose`, `read`, `wait`."""

    def __init__(self, client: StoreClient, keep_on: str, counters: Counters,
                 per_holder: int = PER_HOLDER, refresh_s: float = REFRESH_S) -> None:
        self.client = client
        self.keep_on = keep_on
        self.counters = counters
        self.host = client.host_id
        self.salt = zlib.crc32(self.host.encode())
        self.per_holder = per_holder
        self.refresh_s = refresh_s
        self.busy: dict[str, int] = {}  # reads in flight by holder host
        self.cond = threading.Condition()
        self.view: dict[str, ObjectInfo | None] = {}
        self.read_at = float("-inf")

    # -- choosing ---------------------------------------------------------------------------
    def refresh(self, jobs: Sequence[Job], force: bool = False) -> None:
        """Re-read the replica lists of `jobs`' chunks when older than `refresh_s`."""
        if not jobs or (not force and time.monotonic() - self.read_at < self.refresh_s):
            return
        keys = [j.key for j in jobs]
        infos = self.client.locate(keys)
        with self.cond:
            self.view = dict(zip(keys, infos, strict=True))
            self.read_at = time.monotonic()

    def choose(self, jobs: Sequence[Job]) -> tuple[Job, Location] | None:
        """The best (job, holder) with a free read slot, the slot reserved; None when every
        holder of every job is busy with this fetcher's reads. Raises StoreError for a chunk
        that is gone or whose every holder failed it `ROUNDS` times."""
        with self.cond:
            held = Counter(loc.peer.host_id for j in jobs
                           for loc in (self._info(j).replicas if self.view.get(j.key) else ()))
            best: tuple[tuple[int, ...], Job, Location] | None = None
            for rank, job in enumerate(jobs):
                locs = self._candidates(job)
                for loc in sorted(locs, key=lambda lc: self._holder_key(lc, held, job.index)):
                    if self._free(loc):
                        score = (*self._holder_key(loc, held, job.index)[:3], len(locs), rank)
                        if best is None or score < best[0]:
                            best = (score, job, loc)
                        break
            if best is None:
                return None
            _, job, loc = best
            job.info = self.view[job.key]
            self.busy[loc.peer.host_id] = self.busy.get(loc.peer.host_id, 0) + 1
            return job, loc

    def _info(self, job: Job) -> ObjectInfo:
        info = self.view.get(job.key)
        if info is None or not info.replicas:
            raise StoreError(f"p2p chunk {job.index} ({job.key!r}): not published (or evicted)")
        if info.size != job.chunk.size:
            raise StoreError(f"p2p chunk {job.key!r} is {info.size} bytes, manifest says "
                             f"{job.chunk.size}: republished under the same name?")
        return info

    def _candidates(self, job: Job) -> list[Location]:
        """`job`'s holders not refused this round; a new round when every one was."""
        if job.key not in self.view:
            return []  # not looked up yet (the caller refreshes)
        replicas = list(self._info(job).replicas)
        locs = [loc for loc in replicas if loc.segment.name not in job.refused]
        if not locs:
            job.rounds += 1
            if job.rounds >= ROUNDS:
                raise StoreError(f"p2p chunk {job.index} ({job.key!r}): no holder served it "
                                 f"({job.why})")
            job.refused.clear()
            locs = replicas
        return locs

    def _holder_key(self, loc: Location, held: Counter[str], index: int) -> tuple[int, ...]:
        """Order of preference: this host, not suspect, fewest needed chunks held, then a
        rotation by chunk index and this fetcher so equal holders share the reads."""
        host = loc.peer.host_id
        return (host != self.host, self.client.suspect(loc), held[host],
                zlib.crc32(f"{host}/{index}".encode()) ^ self.salt)

    def _free(self, loc: Location) -> bool:
        host = loc.peer.host_id
        return host == self.host or self.busy.get(host, 0) < self.per_holder

    def wait(self, timeout: float = REFRESH_S) -> None:
        """Wait until one of this fetcher's reads finishes (or `timeout`)."""
        with self.cond:
            self.cond.wait(timeout)

    # -- reading ----------------------------------------------------------------------------
    def read(self, job: Job, loc: Location, buf: memoryview) -> bool:
        """Read `job`'s chunk from `loc` (reserved by `choose`) into `buf` and verify it;
        on success count it and keep a replica. False (the holder refused for this round)
        when the read failed or the bytes do not match the manifest."""
        try:
            why = self._read(loc, job.chunk, buf)
        finally:
            with self.cond:
                self.busy[loc.peer.host_id] -= 1
                self.cond.notify_all()
        if why:
            job.why = why
            job.refused.add(loc.segment.name)
            return False
        self.counters.read_from(loc.peer.host_id)
        self._keep(job, buf)
        return True

    def _read(self, loc: Location, chunk: Chunk, buf: memoryview) -> str:
        """Read one replica into `buf` and verify it; "" on success, else why not."""
        try:
            self.client.read_replica(loc, buf)
        except TransferError as e:
            self.counters.add(failed_reads=1)
            log.info("p2p holder failed", extra={"holder": loc.segment.name, "error": str(e)})
            return f"{loc.segment.name}: {e}"
        if chunk_digest(buf) != chunk.digest:
            self.counters.add(corrupt=1)
            log.warning("p2p chunk failed verification", extra={"holder": loc.segment.name})
            return f"{loc.segment.name}: bytes do not match the manifest"
        return ""

    def _keep(self, job: Job, buf: memoryview) -> None:
        """Add a replica on this host (never fails the fetch: the client counts failures)."""
        info = job.info
        if not self.keep_on or info is None or any(
                r.peer.host_id == self.host or r.segment.name == self.keep_on
                for r in info.replicas):
            return
        if self.client.keep_replica(self.keep_on, job.key, info, buf):
            self.counters.add(kept=1)
