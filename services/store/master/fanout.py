"""Hot-object fan-out: an object many hosts read gains replicas near its readers.

Why: one replica of a popular object (a shared system prompt's KV blocks) puts every reader
behind one node's NIC; a replica on each reading host turns remote reads into shared-memory
ones and spreads the rest over several links. Mooncake's store added this (off by default);
this is the master's half of ours, a part of `state.MasterState` run under its lock.

    lookup from host H, no replica on H ──> reads[(key, H)] += 1 (per window of `window_s`)
    reads reach `threshold` ──> a DRAM segment on H with free room under its high watermark
      (`TierPolicy.alloc_free`: never evicts) gets space; its node gets a COPY naming the
      source replica on another node; it reads the bytes through the transfer engine,
      checks the checksum and reports CommandDone; the replica joins the object (COMMITTED to
      the node, a STORED event), recorded here as an *extra* replica
    a lookup from a host without a replica ──> the replicas in rotated order (`spread`), so
      readers take turns over them instead of all reading the first
    an extra replica not read from its host for a window is *cool*: eviction takes cool extra
      replicas on a segment before anything else (`TierPolicy._evictable`)

An object keeps at most `max_replicas` replicas (its own included); one copy per host. What is
counted are lookups the master sees: a client that caches locations asks once per lease, so the
threshold is in lookups, not bytes read. The counters are a tumbling window (cleared every
`window_s`) capped at `MAX_TRACKED` entries, so a scan over many keys costs bounded memory.

Not journaled under HA: like a spill's copy, a fan-out replica is recorded by its node's
inventory (COMMITTED), which a restarted or new leader rebuilds from; losing one costs a copy,
never an object.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.store.master.records import DRAM, Obj, Rep, Segment

if TYPE_CHECKING:
    from mooncake_k8s.store.master.catalog import Catalog
    from mooncake_k8s.store.master.tiering import TierPolicy

log = logging.getLogger(__name__)

#: (key, host) read counters kept per window at most; reads of further keys are not counted
#: until the window rolls over.
MAX_TRACKED = 100_000


@dataclass
class FanoutSettings:
    """`mooncake store master --fanout ...`: see the module docstring."""

    enabled: bool = False
    threshold: int = 4
    """Lookups of one object from one host without a replica, per window, that add one there.
    A client that keeps reading an object looks it up about every 1.6 s (80% of the default
    2 s read lease; in between it reads from its location cache), so two such readers on a
    host cross 4 within a 10 s window in about 3 s, while a one-off read never does."""
    window_s: float = 10.0
    max_replicas: int = 4
    """Replicas of one object in all (the original ones included)."""

    def check(self) -> None:
        if self.threshold < 1:
            raise InvalidArgument(f"fanout threshold must be >= 1, got {self.threshold}")
        if not self.window_s > 0:
            raise InvalidArgument(f"fanout window must be > 0 s, got {self.window_s}")
        if not 2 <= self.max_replicas <= 16:
            raise InvalidArgument(
                f"fanout max replicas must be 2..16, got {self.max_replicas}")


# -- the policy as plain functions ------------------------------------------------------------


def wants_replica(reads: int, threshold: int, replicas: int, max_replicas: int,
                  on_host: bool) -> bool:
    """Whether the `reads`-th lookup this window from a host should add a replica there:
    at the threshold and every `threshold` lookups after it (a try that found no room is
    retried), while the object is below its cap and has no replica on that host."""
    return (not on_host and replicas < max_replicas and reads >= threshold
            and reads % threshold == 0)


def spread(reps: Sequence[Rep], turn: int) -> list[Rep]:
    """`reps` rotated by `turn`: successive readers start at successive replicas."""
    if not reps:
        return []
    k = turn % len(reps)
    return [*reps[k:], *reps[:k]]


def is_cool(last_read: float, now: float, window_s: float) -> bool:
    """An extra replica not read from its host for a whole window."""
    return now - last_read >= window_s


def pick_target(segments: Sequence[Segment], host: str) -> list[Segment]:
    """DRAM segments of `host` that may take a replica, the emptiest first."""
    segs = [s for s in segments if s.alive and s.tier == DRAM and s.node.host_id == host]
    segs.sort(key=lambda s: s.alloc.free_bytes, reverse=True)
    return segs


def pick_source(reps: Sequence[Rep]) -> Rep | None:
    """The replica to copy from: a live DRAM one if any (SSD reads are slower)."""
    live = [r for r in reps if r.seg.alive]
    live.sort(key=lambda r: r.seg.tier != DRAM)
    return live[0] if live else None


# -- the state ------------------------------------------------------------------------------------


class Extra:
    """A replica fan-out added: kept while read from its host, the first to go once cool."""

    __slots__ = ("last_read", "obj", "seg")

    def __init__(self, obj: Obj, seg: Segment, now: float) -> None:
        self.obj = obj
        self.seg = seg
        self.last_read = now


class Fanout:
    """Read counters, the extra replicas and the fan-out counters (see the module docstring)."""

    def __init__(self, settings: FanoutSettings, catalog: Catalog) -> None:
        settings.check()
        self.settings = settings
        self._cat = catalog
        self._reads: dict[tuple[str, str], int] = {}
        self._window_end = 0.0
        self._hot: set[str] = set()
        self._hot_prev = 0
        self._extras: dict[str, list[Extra]] = {}  # by key
        self._turn = 0
        self.added = 0
        self.dropped = 0
        self.started = 0

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def hot_objects(self) -> int:
        """Objects that reached the threshold in this window or the last one (the larger)."""
        return max(len(self._hot), self._hot_prev)

    @property
    def extra_replicas(self) -> int:
        return sum(len(v) for v in self._extras.values())

    def _roll(self, now: float) -> None:
        if now >= self._window_end:
            self._reads.clear()
            self._hot_prev = len(self._hot)
            self._hot = set()
            self._window_end = now + self.settings.window_s

    def note_read(self, obj: Obj, host: str, tiers: TierPolicy) -> None:
        """A lookup of `obj` from `host`: count it, refresh an extra replica there, and start
        a fan-out copy when the count calls for one."""
        now = self._cat.now()
        self._roll(now)
        at = obj.at
        if isinstance(at, Segment):
            if at.node.host_id == host:
                return
            n_reps = 1
        else:
            extras = self._extras.get(obj.key)
            if extras:
                for e in extras:
                    if e.seg.node.host_id == host:
                        e.last_read = now
            if any(r.seg.node.host_id == host for r in at):
                return
            n_reps = len(at)
        k = (obj.key, host)
        reads = self._reads.get(k, 0) + 1
        if reads == 1 and len(self._reads) >= MAX_TRACKED:
            return
        self._reads[k] = reads
        s = self.settings
        if wants_replica(reads, s.threshold, n_reps, s.max_replicas, False):
            self._hot.add(obj.key)
            self._start(obj, host, tiers)

    def _start(self, obj: Obj, host: str, tiers: TierPolicy) -> None:
        if obj.copying or obj.hidden:
            return  # a spill, promotion or fan-out of it is running: later
        src = pick_source(obj.reps)
        if src is None:
            return
        size = obj.size
        for seg in pick_target(list(self._cat.segments.values()), host):
            off = tiers.alloc_free(seg, size) if seg.alloc.capacity >= size else None
            if off is not None:
                self.started += 1
                tiers.start_copy("fanout", obj, src, Rep(seg, off), node=seg.node)
                return

    def turn(self) -> int:
        """The next rotation for `spread`."""
        self._turn += 1
        return self._turn

    def joined(self, obj: Obj, seg: Segment) -> None:
        """A fan-out copy ended well: its replica is an extra one."""
        self.added += 1
        self._extras.setdefault(obj.key, []).append(Extra(obj, seg, self._cat.now()))
        log.info("fan-out replica added", extra={"key": obj.key, "segment": seg.name})

    def _live(self, e: Extra) -> bool:
        return self._cat.objects.get(e.obj.key) is e.obj and e.obj.on(e.seg)

    def cool_on(self, seg: Segment) -> list[Obj]:
        """Objects whose extra replica on `seg` is cool (stale records are dropped here)."""
        now = self._cat.now()
        out = []
        window = self.settings.window_s
        for key in list(self._extras):
            keep = []
            for e in self._extras[key]:
                if not self._live(e):
                    continue
                keep.append(e)
                if e.seg is seg and is_cool(e.last_read, now, window):
                    out.append(e.obj)
            if keep:
                self._extras[key] = keep
            else:
                del self._extras[key]
        return out

    def is_extra(self, obj: Obj, seg: Segment) -> bool:
        return any(e.seg is seg and e.obj is obj for e in self._extras.get(obj.key, ()))

    def evicted(self, obj: Obj, seg: Segment) -> None:
        """A replica of `obj` on `seg` was evicted: count it if it was an extra one."""
        extras = self._extras.get(obj.key)
        if not extras:
            return
        keep = [e for e in extras if not (e.seg is seg and e.obj is obj)]
        if len(keep) < len(extras):
            self.dropped += 1
            log.info("fan-out replica dropped", extra={"key": obj.key, "segment": seg.name})
        if keep:
            self._extras[obj.key] = keep
        else:
            del self._extras[obj.key]
