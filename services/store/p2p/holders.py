"""Reading one chunk from the hosts that hold it: the P2P store's data path.

Who holds what is the store master's replica list: a chunk is a store object, the publisher's
storage node holds its first replica and every fetcher adds one on its own host's node
(`ReplicaStart`/`ReplicaEnd`, the client's `Keeper`). So there is no second tracker to keep
consistent with the bytes: a holder that dies drops out of the list when the master notices,
and a replica the master lists is one a node really has.

This module reads a chunk from a holder the P2P layer picks (spread over the holders by chunk
index, this host's own first), verifying it against the manifest's digest rather than trusting
the transport; it uses the StoreClient's lookup, transfer engine and keeper directly because
the client's own reads always pick the nearest replica, which would send every fetcher to the
same holder.
"""

from __future__ import annotations

import logging
import threading
import zlib
from dataclasses import dataclass, field

from mooncake_k8s.common.errors import StoreError, TransferError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.p2p.manifest import Chunk, chunk_digest
from mooncake_k8s.store.wire import Location, ObjectInfo
from mooncake_k8s.transfer import ReadOp

log = logging.getLogger(__name__)

# Reads one fetcher has in flight from any one other host. Without a cap, a fetcher with
# `parallel` threads asks the only holder at the start (the source) for `parallel` chunks at
# once, every fetcher does the same, and by the time any of them holds a chunk to serve the
# source has sent nearly everything to everyone: peers served nothing.
PER_HOLDER = 1


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


class Holders:
    """Chunk reads for one fetcher. `keep_on` is a segment (this host's, when it has one) to
    add a replica of each fetched chunk to ("" keeps nothing), so the fetcher serves what it
    fetched."""

    def __init__(self, client: StoreClient, keep_on: str, counters: Counters,
                 per_holder: int = PER_HOLDER) -> None:
        self.client = client
        self.keep_on = keep_on
        self.counters = counters
        self.host = client._host_id
        self.salt = zlib.crc32(self.host.encode())
        self.per_holder = per_holder
        self.busy: dict[str, int] = {}  # reads in flight by holder host
        self.freed = threading.Condition()
        self.gen = 0  # reads finished: a waiter that saw a busy holder checks it first

    def order(self, info: ObjectInfo, index: int) -> list[Location]:
        """This host's replicas first, then the others rotated by chunk index (and by a salt
        of this host's) so that concurrent chunks, and fetchers, spread over every holder; a
        holder that failed lately is tried last, so a dead or frozen one costs one timeout,
        not one per chunk."""
        mine = [loc for loc in info.replicas if loc.peer.host_id == self.host]
        others = sorted((loc for loc in info.replicas if loc.peer.host_id != self.host),
                        key=lambda loc: loc.segment.name)
        if others:
            k = (index + self.salt) % len(others)
            others = others[k:] + others[:k]
        # holders that failed a read lately (the client's suspect_s) go last
        return list(self.client._health.order(mine + others))

    def fetch(self, key: str, index: int, chunk: Chunk, buf: memoryview, *,
              wait: bool = True, rounds: int = 3) -> bool:
        """Fill `buf` with the chunk's verified bytes or raise StoreError; each round asks
        the master for the current holders and tries each once. A holder this fetcher has
        `per_holder` reads in flight from is skipped; when one was and no other served the chunk,
        returns False at once (`wait=False`: the caller fetches another chunk first) or waits for a
        read to finish and asks the master again (new holders appear as peers keep chunks)."""
        why = "not published"
        tried = 0
        while tried < rounds:
            info = self.client._lookup([key], use_cache=False)[0]
            if info is None:
                break
            if info.size != chunk.size:
                raise StoreError(f"p2p chunk {key!r} is {info.size} bytes, manifest says "
                                 f"{chunk.size}: republished under the same name?")
            gen, skipped = -1, False
            for loc in self.order(info, index):
                if not self._reserve(loc):
                    gen, skipped = self.gen, True  # reads finished by the time it was busy
                    continue
                try:
                    why = self._read(loc, chunk, buf)
                finally:
                    self._release(loc)
                if not why:
                    self.counters.read_from(loc.peer.host_id)
                    self._keep(key, info, loc, buf)
                    return True
            if not skipped:  # a round: every holder asked once
                tried += 1
                continue
            if not wait:
                return False
            with self.freed:  # every holder busy: wait for one of this fetcher's reads
                if self.gen == gen:
                    self.freed.wait(1.0)
        raise StoreError(f"p2p chunk {index} ({key!r}): no holder served it ({why})")

    def _reserve(self, loc: Location) -> bool:
        """Count a read from `loc`'s host unless this fetcher has `per_holder` in flight."""
        host = loc.peer.host_id
        with self.freed:
            if host != self.host and self.busy.get(host, 0) >= self.per_holder:
                return False
            self.busy[host] = self.busy.get(host, 0) + 1
            return True

    def _release(self, loc: Location) -> None:
        with self.freed:
            self.busy[loc.peer.host_id] -= 1
            self.gen += 1
            self.freed.notify_all()

    def _read(self, loc: Location, chunk: Chunk, buf: memoryview) -> str:
        """Read one replica into `buf` and verify it; "" on success, else why not."""
        try:
            self.client.engine.read(loc.peer, [ReadOp(loc.segment, loc.offset, buf)])
        except TransferError as e:
            self.client._failed(loc.peer)
            self.counters.add(failed_reads=1)
            log.info("p2p holder failed", extra={"holder": loc.segment.name, "error": str(e)})
            return f"{loc.segment.name}: {e}"
        self.client._health.succeeded(loc.peer.address)
        if chunk_digest(buf) != chunk.digest:
            self.counters.add(corrupt=1)
            log.warning("p2p chunk failed verification", extra={"holder": loc.segment.name})
            return f"{loc.segment.name}: bytes do not match the manifest"
        return ""

    def _keep(self, key: str, info: ObjectInfo, loc: Location, buf: memoryview) -> None:
        """Add a replica on this host (never fails the fetch: the keeper counts failures)."""
        if not self.keep_on or any(r.peer.host_id == self.host or r.segment.name == self.keep_on
                                   for r in info.replicas):
            return
        if self.client._keeper.keep(self.keep_on, [(key, info, buf)]):
            self.counters.add(kept=1)
