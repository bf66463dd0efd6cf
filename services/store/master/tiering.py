"""Where an object's bytes go and which bytes leave: placement, eviction, spill and promotion.

A part of `state.MasterState`, kept apart because it is a policy of its own: which segment
takes a new replica, which replicas leave when a segment is full, and how DRAM victims move to
SSD (and SSD hits back to DRAM), with the copies that takes. It works on the shared records
through `catalog.Catalog` and runs under the state's lock like everything else there.

The watermark rule, on every tier: no allocation ever takes a segment above its high watermark
(`_room`), whether it is a new object, a spill destination or a promotion; the only exception
is one object larger than the watermark alone, placed in an empty segment.

Eviction order is approximate LRU, the CLOCK ("second chance") way: each segment keeps its
objects in a queue in the order they arrived, and a lookup only sets a mark on the object
(`REF` in `Obj.state`, one flag per replica for objects with several). A scan for victims
walks the queue from its head; a marked object loses its mark and goes to the tail instead
of being taken, so an object looked up since the scan last passed it is spared for one more
round. For the plain cases that is exactly LRU (an object read since it was stored outlives
one that was not); it differs only in the order among objects that were all read between two
scans. An exact LRU list (an OrderedDict moved to the end on every lookup) cost ~100 bytes per
object and a dict operation per looked-up key; the queue costs 8 bytes and lookups touch
nothing but the object itself.

A DRAM segment that has no room for a new object starts spilling down to its low watermark
(with room for the object), LRU first: each victim is copied to an SSD segment of its node that
has room, made there if need be by evicting the SSD's own LRU objects (the coldest in the
node). A spill is a copy, so the victim's DRAM space is freed only once the copy is done;
meanwhile new objects go to other DRAM segments or to SSD (a burst faster than spilling lands
on SSD instead of dropping cached data). Only when no segment has room are victims dropped
synchronously, just enough of them, LRU first, soft-pinned last. A segment found above its high
watermark anyway (rebuilt from an inventory, say) is shrunk to its low watermark by `tick`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mooncake_k8s.common.errors import NoSpace, ObjectTooLarge
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.records import (
    COPYING,
    DRAM,
    LEASE,
    PINNED,
    SSD,
    Copy,
    Node,
    Obj,
    Rep,
    Segment,
)

if TYPE_CHECKING:
    from mooncake_k8s.store.master.fanout import Fanout

log = logging.getLogger(__name__)

_EV = pb.BlockEvent
_CMD = pb.NodeCommand


class TierPolicy:
    """Placement, eviction, spilling and promotion over the catalog's segments, and the copies
    that spills and promotions are; see the module docstring."""

    def __init__(self, catalog: Catalog, *, high_watermark: float, low_watermark: float,
                 copy_timeout_s: float) -> None:
        self._cat = catalog
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.copy_timeout_s = copy_timeout_s
        self.copies: dict[int, Copy] = {}
        """Spills, promotions and fan-out copies in flight, by command id."""
        self.fanout: Fanout | None = None
        """Hot-object fan-out (`fanout`), when on: its cool extra replicas are evicted first."""

    # -- room ----------------------------------------------------------------------------------

    def _room(self, seg: Segment, need: int) -> bool:
        """Whether `need` (rounded) more bytes keep `seg` at or below its high watermark."""
        return seg.alloc.used + need <= max(self.high_watermark * seg.alloc.capacity, need)

    # -- placement -----------------------------------------------------------------------------

    def place(
        self, size: int, n: int, placement: int, preferred: str, host_id: str,
        evict: bool = True, segments: Sequence[str] = (), fallback: bool = True,
    ) -> list[Rep]:
        """Pick and allocate `n` replicas on distinct nodes, each under its high watermark.

        Named `segments` first, one replica on each, in order (`_place_named`); then the rest
        up to max(n, len(segments)): DRAM segments with room in placement order first (one
        without room starts spilling); then SSD segments with room; then (unless `evict` is
        False: a space lease's generous extent is not worth dropping cached objects for) DRAM
        made room in by eviction, then SSD likewise. Only `n` replicas are required: the
        extra ones the names ask for are placed where distinct nodes with space allow (a copy
        placed by host is worth having, not worth failing a put for). With `fallback` False,
        a named segment that cannot take its replica raises NoSpace instead of being replaced.
        """
        alive = list(self._cat.segments.values())
        if not alive:
            raise NoSpace("no storage segments are registered")
        largest = max(s.alloc.capacity for s in alive)
        if size > largest:
            raise ObjectTooLarge(
                f"object of {size} bytes is too large for any segment (largest {largest})"
            )
        fits = [s for s in alive if s.alloc.capacity >= size]
        n_nodes = len({s.node.node_id for s in fits})
        if n > n_nodes:
            raise NoSpace(f"{n} replicas need {n} distinct nodes; {n_nodes} can hold the object")
        want = min(max(n, len(segments)), n_nodes)
        chosen = self._place_named(size, segments, evict) if segments else []
        if not fallback and len(chosen) < len({self._cat.segments[s].node.node_id
                                                for s in segments if s in self._cat.segments}):
            self._free_all(chosen, size)
            raise NoSpace(f"a named segment of {list(segments)} has no room for {size} bytes")
        fits.sort(key=lambda s: s.alloc.free_bytes, reverse=True)
        if placement == pb.PREFERRED and preferred:
            fits.sort(key=lambda s: s.name != preferred)
        elif placement in (pb.LOCAL_FIRST, pb.PLACEMENT_UNSPECIFIED) and host_id:
            fits.sort(key=lambda s: s.node.host_id != host_id)
        self._place_rest(fits, size, want, evict, chosen)
        if len(chosen) < n:
            self._free_all(chosen, size)
            raise NoSpace(
                f"no space for {size} bytes x{n}: everything evictable is leased, pinned or "
                "being written"
            )
        return chosen

    def _place_named(self, size: int, names: Sequence[str], evict: bool) -> list[Rep]:
        """A replica on each named segment that is known, holds the object, is on a node not
        used yet and has room (made by evicting its LRU objects, as any put there would,
        when `evict`). The others are skipped: the caller places their replicas elsewhere."""
        chosen: list[Rep] = []
        used: set[str] = set()
        for name in names:
            seg = self._cat.segments.get(name)
            if seg is None or seg.node.node_id in used or seg.alloc.capacity < size:
                continue
            off = self._alloc_in_room(seg, size)
            if off is None and evict:
                off = self._alloc_evicting(seg, size)
            if off is not None:
                chosen.append(Rep(seg, off))
                used.add(seg.node.node_id)
        return chosen

    def _place_rest(
        self, fits: list[Segment], size: int, want: int, evict: bool, chosen: list[Rep]
    ) -> None:
        """Add replicas to `chosen` (in place) up to `want`, on nodes it does not use yet, in
        the passes `place` describes."""
        drams = [s for s in fits if s.tier == DRAM]
        ssds = [s for s in fits if s.tier != DRAM]
        passes = [(drams, False), (ssds, False)]
        if evict:
            passes += [(drams, True), (ssds, True)]
        used = {r.seg.node.node_id for r in chosen}
        for segs, evicting in passes:
            for seg in segs:
                if len(chosen) >= want:
                    return
                if seg.node.node_id in used:
                    continue
                off = (self._alloc_evicting(seg, size) if evicting
                       else self._alloc_in_room(seg, size))
                if off is not None:
                    chosen.append(Rep(seg, off))
                    used.add(seg.node.node_id)

    @staticmethod
    def _free_all(reps: list[Rep], size: int) -> None:
        for r in reps:
            r.seg.alloc.free(r.offset, size)

    def alloc_free(self, seg: Segment, size: int) -> int | None:
        """Allocate only from free room under the high watermark, with no side effect at all
        (no spill, no eviction): a copy that is merely worth having (an added replica) never
        displaces anything. None when it does not fit so."""
        if not self._room(seg, seg.alloc.rounded(size)):
            return None
        return seg.alloc.alloc(size)

    def _alloc_in_room(self, seg: Segment, size: int) -> int | None:
        """Allocate without dropping anything. A DRAM segment without room starts spilling to
        its SSD (never evicting here), which makes room for the puts after this one."""
        need = seg.alloc.rounded(size)
        if not self._room(seg, need) and seg.tier == DRAM:
            self.shrink(seg, incoming=need, spill_only=True)  # may drop DRAM copies of SSD ones
        if not self._room(seg, need):
            return None
        return seg.alloc.alloc(size)

    def _evictable(self, seg: Segment, deficit: int, pinned_ok: bool) -> tuple[list[Obj], int]:
        """LRU-first victims on `seg` whose replicas free at least `deficit` bytes, if possible.

        The CLOCK scan (see the module docstring): stale entries are dropped, marked objects
        lose their mark and move to the tail, and the rest (victims, and objects that cannot
        go now: leased, being copied, pinned) go back to the head in their order, so the
        victims stay first in line whether or not the caller evicts them all. It walks the
        queue at most twice: the second round meets the objects the first one unmarked.
        """
        victims: list[Obj] = []
        kept: list[Obj] = []
        seen: set[int] = set()
        gain = 0
        rounded = seg.alloc.rounded
        queue = seg.queue
        busy = COPYING | (0 if pinned_ok else PINNED)
        cool: set[int] = set()
        if self.fanout is not None:  # cool fan-out replicas go before anything else
            for obj in self.fanout.cool_on(seg):
                if gain < deficit and obj.state < LEASE and not obj.state & COPYING:
                    victims.append(obj)
                    cool.add(id(obj))
                    gain += rounded(obj.size)
        for _ in range(2 * len(queue)):
            if gain >= deficit or not queue:
                break
            obj = queue.popleft()
            if not obj.on(seg) or id(obj) in seen:
                continue  # stale: it left this segment, or a later entry of it was seen
            if obj.take_ref(seg):
                queue.append(obj)  # second chance
                continue
            seen.add(id(obj))
            kept.append(obj)
            if obj.state >= LEASE or obj.state & busy or id(obj) in cool:
                continue
            victims.append(obj)
            gain += rounded(obj.size)
        queue.extendleft(reversed(kept))
        return victims, gain

    def _alloc_evicting(self, seg: Segment, size: int) -> int | None:
        """Allocate under the high watermark, dropping LRU objects (soft-pinned last) as needed."""
        need = seg.alloc.rounded(size)
        limit = max(self.high_watermark * seg.alloc.capacity, need)
        if self._room(seg, need):
            off = seg.alloc.alloc(size)
            if off is not None:
                return off
        for pinned_ok in (False, True):
            enough = math.ceil(seg.alloc.used + need - limit)
            if enough > 0 and self._evictable(seg, enough, pinned_ok)[1] < enough:
                continue  # evicting everything allowed would not bring it under the limit
            while True:
                deficit = max(int(seg.alloc.used + need - limit), need - seg.alloc.free_bytes, 1)
                victims, _ = self._evictable(seg, deficit, pinned_ok)
                if not victims:
                    break
                for obj in victims:
                    self._evict(obj, seg)
                if self._room(seg, need):
                    off = seg.alloc.alloc(size)  # None when the free space is fragmented
                    if off is not None:
                        return off
        return None

    def _evict(self, obj: Obj, seg: Segment) -> None:
        if obj.on(seg):
            self._cat.drop_rep(obj, obj.rep_on(seg), _EV.EVICTED)
            self._cat.evictions += 1
            if self.fanout is not None:
                self.fanout.evicted(obj, seg)

    # -- shrinking and spilling ----------------------------------------------------------------

    def shrink(
        self, seg: Segment, incoming: int = 0, pinned_too: bool = True, spill_only: bool = False
    ) -> None:
        """Evict (or spill) LRU-first down to the low watermark, leaving room for `incoming`
        more bytes. Soft-pinned objects go only when unpinned ones cannot bring the segment
        back to the high watermark, then only as far as that (never when not `pinned_too`).
        With `spill_only`, victims that cannot be spilled stay."""
        rounded = seg.alloc.rounded
        ssds = (
            [s for s in seg.node.segments if s.tier == SSD and s.alive] if seg.tier == DRAM else []
        )
        if spill_only and not ssds:
            return
        for pinned_ok in (False, True) if pinned_too else (False,):
            mark = self.high_watermark if pinned_ok else self.low_watermark
            target = mark * seg.alloc.capacity - incoming
            excess = seg.alloc.used - seg.spilling - target
            if excess <= 0:
                return
            victims, _ = self._evictable(seg, int(excess) + 1, pinned_ok)
            for obj in victims:
                if seg.alloc.used - seg.spilling <= target:
                    return
                reps = obj.reps
                rep = next(r for r in reps if r.seg is seg)
                extra = self.fanout is not None and self.fanout.is_extra(obj, seg)
                if ssds and not extra and not any(r.seg.tier == SSD for r in reps):
                    dst = self._spill_target(ssds, rounded(obj.size))
                    off = dst.alloc.alloc(obj.size) if dst is not None else None
                    if dst is not None and off is not None:
                        seg.spilling += rounded(obj.size)
                        self.start_copy("spill", obj, rep, Rep(dst, off))
                        continue
                if spill_only and not extra and not any(r.seg.tier == SSD for r in reps):
                    return  # could not be spilled: it stays
                self._evict(obj, seg)  # (a copy on SSD or another node is kept, if any)

    def _spill_target(self, ssds: list[Segment], need: int) -> Segment | None:
        """An SSD segment that can take `need` bytes under its high watermark: one with room,
        else one made room on by evicting its own LRU objects (never soft-pinned ones, which
        are worth more than a DRAM victim). None: the DRAM victim is dropped instead."""
        ssds.sort(key=lambda s: s.alloc.free_bytes, reverse=True)
        for ssd in ssds:
            if self._room(ssd, need):
                return ssd
        for ssd in ssds:
            self.shrink(ssd, incoming=need, pinned_too=False)
            if self._room(ssd, need):
                return ssd
        return None

    # -- promotion -----------------------------------------------------------------------------

    def promote(self, obj: Obj) -> None:
        """Copy an SSD-only object back into a DRAM segment of its node that has room."""
        src = next((r for r in obj.reps if r.seg.alive), None)
        if src is None:
            return
        drams = [s for s in src.seg.node.segments if s.tier == DRAM and s.alive]
        drams.sort(key=lambda s: s.alloc.free_bytes, reverse=True)
        for seg in drams:
            if not self._room(seg, seg.alloc.rounded(obj.size)):
                continue
            off = seg.alloc.alloc(obj.size)
            if off is not None:
                self.start_copy("promote", obj, src, Rep(seg, off))
                return

    def start_copy(
        self, kind: str, obj: Obj, src: Rep, dst: Rep, node: Node | None = None
    ) -> None:
        """Ask `node` (by default the source's) to copy `obj` from `src` to `dst`; a `node`
        other than the source's reads it through the transfer engine (fan-out)."""
        obj.copying = True
        node = node or src.seg.node
        cmd_id = self._cat.command(
            node, _CMD.COPY, obj.key, dst.seg, dst.offset, obj.size, obj.checksum, src,
            remote=node is not src.seg.node,
        )
        deadline = self._cat.now() + self.copy_timeout_s
        cp = self.copies[cmd_id] = Copy(cmd_id, kind, obj, src, dst, deadline)
        cp.node = node

    # -- copies ----------------------------------------------------------------------------------

    def finish_copy(self, cp: Copy, ok: bool, error: str) -> None:
        """A spill or promotion ended (`ok` or not): the destination replica joins the object,
        or is freed; a spill that succeeded drops its DRAM source unless it is leased."""
        obj = cp.obj
        obj.copying = False
        if cp.kind == "spill":
            cp.src.seg.spilling -= cp.src.seg.alloc.rounded(obj.size)
        live = (
            not obj.hidden
            and self._cat.objects.get(obj.key) is obj
            and cp.src in obj.reps
            and cp.dst.seg.alive
        )
        if live and cp.kind == "fanout":  # one copy per host: a reader may have kept one
            host = cp.dst.seg.node.host_id
            live = not any(r.seg.node.host_id == host for r in obj.reps)
        if not ok or not live:
            self._cat.free_rep(obj, cp.dst, committed=False)
            if not ok:
                log.warning(
                    "copy failed",
                    extra={"kind": cp.kind, "key": obj.key, "node_id": cp.node.node_id,
                           "error": error},
                )
                if cp.kind == "spill" and live and obj.leases == 0:
                    self._cat.drop_rep(obj, cp.src, _EV.EVICTED)
                    self._cat.evictions += 1
            return
        dst = cp.dst
        obj.set_reps([*obj.reps, dst])
        dst.seg.enqueue(obj)
        self._cat.command(dst.seg.node, _CMD.COMMITTED, obj.key, dst.seg, dst.offset, obj.size,
                          obj.checksum)
        if cp.kind == "spill":
            self._cat.spills += 1
            self._cat.emit(_EV.SPILLED, obj.key, obj.size, dst.seg)
            if obj.leases == 0:
                self._cat.drop_rep(obj, cp.src, 0)
        elif cp.kind == "fanout":
            self._cat.emit(_EV.STORED, obj.key, obj.size, dst.seg)
            if self.fanout is not None:
                self.fanout.joined(obj, dst.seg)
        else:
            self._cat.promotions += 1
            self._cat.emit(_EV.PROMOTED, obj.key, obj.size, dst.seg)

    def copy_done(self, node_id: str, cmd_id: int, ok: bool, error: str) -> bool:
        """A node reported a COPY; False when it is unknown (expired, node replaced)."""
        cp = self.copies.get(cmd_id)
        if cp is None or cp.node.node_id != node_id:
            return False
        del self.copies[cmd_id]
        self.finish_copy(cp, ok, error)
        return True

    def expire_copies(self, now: float) -> None:
        for cp in [c for c in self.copies.values() if c.deadline <= now]:
            del self.copies[cp.cmd_id]
            self.finish_copy(cp, False, "timed out")

    def cancel_copies(self, node: Node) -> None:
        """Forget the copies `node`'s old process was asked to make (it restarted): their
        destinations are freed, their sources left as they are."""
        for cp in [c for c in self.copies.values() if c.node is node]:
            del self.copies[cp.cmd_id]
            cp.obj.copying = False
            if cp.kind == "spill":
                cp.src.seg.spilling -= cp.src.seg.alloc.rounded(cp.obj.size)
            self._cat.free_rep(cp.obj, cp.dst, committed=False)

    def forget_copies(self, node: Node) -> None:
        """Forget the copies of a node that is gone (its segments with it)."""
        for cp in list(self.copies.values()):
            if cp.node is node:
                del self.copies[cp.cmd_id]
                cp.obj.copying = False
