"""The Conductor's global KV index: which segments hold each block, from the store's events.

The scheduler asks one question per request, for every prefill candidate at once: how long is
the prompt's prefix that this instance has locally, and how long is the prefix available
anywhere in the pool? Block keys are chained (a key stands for its whole prefix), so both are
walks over the prompt's keys.

Representation, chosen for that walk: each segment gets a bit; each key maps to the bitmask of
segments holding it. An instance is the mask of its local segments, so "does instance i have
block k" is one AND, and the walk costs one lookup per block, a few ANDs per distinct holder
mask along the prefix, and one AND per instance (at C speed). Python ints are arbitrary-width,
so any number of segments works.

Where the keys live: our own block keys (32 hex characters) in a `blocktable.BlockTable`,
whose value is the id of the key's holder mask (`_mask_of`); a prompt's keys are looked up
there all at once, so the cache misses of a million-key table overlap instead of adding up (a
dict lookup per block was most of a decision: about 0.5 us each at a million keys). Any other
key (SGLang's page names, the simulator's ints, tests' names) lives in a dict of masks and is
walked key by key, with the same answer. The price is on the event side: a store event on one
of our keys costs about 3 us instead of 1 (decoding the key, probing in Python, counting the
mask ids' users so that ids are reused), a million-key index builds in about three times as
long, and it takes 134 MB (4M slots of 32 bytes) where the dict and its key strings took 112 MB
(231 MB at the peak of a doubling, which holds the old and the new rows).

Events (`STORED`, `EVICTED`, `REMOVED`, `SPILLED`, `PROMOTED`) update the masks; a key whose
mask reaches zero is dropped, so the scheduler never routes to a cache that has gone cold. Each
connection to the store starts with a snapshot of what it holds, which replaces the index
(`clear`, then the snapshot's STORED events): a restarted Conductor, or one whose stream broke
(master restart, cut off for falling behind), is warm again as soon as it reconnects. A stale
or empty index costs cache hits, never correctness (prefill asks the store itself and
recomputes what is missing).

`serving.indexfeed.IndexFeeder` runs the store's `Watch` stream in a thread and hands events
to the event loop, so the index is only ever touched from one thread; this module does no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat, takewhile
from typing import TYPE_CHECKING

import numpy as np

from mooncake_k8s.conductor.sched import blocktable

if TYPE_CHECKING:
    from mooncake_k8s.common.rpc import store_pb2

# BlockEvent.Kind and Tier values (store.proto); kept as ints so the simulator and the
# benchmark can feed the index without protobuf objects.
STORED, EVICTED, REMOVED, SPILLED, PROMOTED = 1, 2, 3, 4, 5
DRAM, SSD = 1, 2
_SHARED_MASKS = 1 << 16
_FEW_BITS = 8


@dataclass(slots=True)
class Match:
    """The answer for one prompt: prefix lengths in blocks."""

    global_blocks: int
    """Leading blocks held somewhere (any segment, any tier)."""
    dram_blocks: int
    """Leading blocks held in some DRAM segment (<= global_blocks)."""
    local_blocks: list[int]
    """Per candidate: leading blocks held in that candidate's own segments."""
    holding: list[int] = field(default_factory=list)
    """The candidates whose `local_blocks` is not 0, ascending (most hold nothing: a picker
    costs those once and visits only these)."""


class KVIndex:
    def __init__(self) -> None:
        self._table = blocktable.BlockTable()
        """Our block keys -> holder mask id."""
        self._mask_of: list[int] = [0]
        """Holder mask id -> mask; id 0 is the empty mask (absent)."""
        self._id_of: dict[int, int] = {0: 0}
        self._refs: list[int] = [0]
        """Keys of the table per mask id; an id whose count drops to 0 is reused."""
        self._free_ids: list[int] = []
        self._holders: dict[Hashable, int] = {}
        """Every other key -> its holder mask."""
        self._masks: dict[int, int] = {}
        """One int object per distinct holders mask, shared by every key with that mask: a
        million keys have a few thousand masks, which then stay in the CPU cache, so the
        prefix walk misses the cache only for the keys themselves."""
        self._bits: dict[str, int] = {}
        self._names: list[str] = []
        self._nodes: list[str] = []
        self._blocks: list[int] = []
        self.ssd_mask = 0
        self._cand_masks: list[int] = []
        self._by_bit: dict[int, list[int]] = {}
        """Segment bit (as the int 1 << bit) -> the candidates whose mask has it."""
        self.events = 0
        self.clears = 0

    # -- segments --------------------------------------------------------------------------

    def segment(self, name: str, node_id: str = "", tier: int = DRAM) -> int:
        """The bit of a segment (registered on first sight)."""
        bit = self._bits.get(name)
        if bit is None:
            bit = len(self._names)
            self._bits[name] = bit
            self._names.append(name)
            self._nodes.append(node_id)
            self._blocks.append(0)
            if tier == SSD:
                self.ssd_mask |= 1 << bit
        elif node_id and not self._nodes[bit]:
            self._nodes[bit] = node_id
        return bit

    def mask(self, segments: Iterable[str]) -> int:
        """The mask of named segments (an instance's local ones); unknown names are
        registered, so a segment that has no blocks yet still identifies its instance."""
        m = 0
        for s in segments:
            if s:
                m |= 1 << self.segment(s)
        return m

    @property
    def segment_names(self) -> Sequence[str]:
        """Every segment seen so far, in bit order (grows only: a new name here is a segment
        the router may not yet know the host of)."""
        return self._names

    def blocks_in(self, segment: str) -> int:
        bit = self._bits.get(segment)
        return 0 if bit is None else self._blocks[bit]

    # -- updates ---------------------------------------------------------------------------

    def _get(self, key: Hashable) -> int:
        """The holder mask of a key (0: none)."""
        c = blocktable.code(key)
        if c is None:
            return self._holders.get(key, 0)
        return self._mask_of[self._table.get(*c)]

    def _change(self, key: Hashable, set_bits: int, clear_bits: int) -> int:
        """Set then clear bits of a key's holder mask (a key left with none is forgotten);
        returns the mask it had. One key decoding and one table probe for the usual event."""
        c = blocktable.code(key)
        if c is None:
            h = self._holders.get(key, 0)
            m = (h | set_bits) & ~clear_bits
            if m != h:
                if m:
                    self._holders[key] = self._shared(m)
                else:
                    del self._holders[key]
            return h
        table = self._table
        a, b = c
        slot = table.find(a, b)
        i = table.value(slot) if slot >= 0 else table.get(a, b) if table.stashed else 0
        h = self._mask_of[i]
        m = (h | set_bits) & ~clear_bits
        if m != h:
            j = self._id(m) if m else 0
            if slot >= 0:
                table.assign(slot, j)
            elif i:
                table.set(a, b, j)
            else:
                table.insert(a, b, j)
            if i:
                self._release(i, 1)
        return h

    def _id(self, mask: int) -> int:
        """The id of a holder mask, counted as held by one more key."""
        i = self._id_of.get(mask)
        if i is None:
            if self._free_ids:
                i = self._free_ids.pop()
                self._mask_of[i] = mask
            else:
                i = len(self._mask_of)
                self._mask_of.append(mask)
                self._refs.append(0)
            self._id_of[mask] = i
        self._refs[i] += 1
        return i

    def _release(self, i: int, n: int) -> None:
        self._refs[i] -= n
        if not self._refs[i]:
            del self._id_of[self._mask_of[i]]
            self._free_ids.append(i)

    def add(self, key: Hashable, bit: int) -> None:
        if not self._change(key, 1 << bit, 0) >> bit & 1:
            self._blocks[bit] += 1

    def _shared(self, mask: int) -> int:
        masks = self._masks
        if len(masks) >= _SHARED_MASKS:  # stale masks pile up; keys keep the ones they have
            masks.clear()
        return masks.setdefault(mask, mask)

    def discard(self, key: Hashable, bit: int) -> None:
        if self._change(key, 0, 1 << bit) >> bit & 1:
            self._blocks[bit] -= 1

    def apply(self, kind: int, key: Hashable, segment: str, node_id: str = "",
              tier: int = DRAM) -> None:
        """One store event. A spill moves the block from the node's DRAM to its SSD (the
        master drops the DRAM copy without an event of its own)."""
        self.events += 1
        bit = self.segment(segment, node_id, tier)
        if kind in (STORED, PROMOTED):
            self.add(key, bit)
        elif kind in (EVICTED, REMOVED):
            self.discard(key, bit)
        elif kind == SPILLED:
            h = self._get(key)
            node = node_id or self._nodes[bit]
            for other in _bits_of(h & ~self.ssd_mask):
                if self._nodes[other] == node:
                    self.discard(key, other)
            self.add(key, bit)

    def apply_event(self, ev: store_pb2.BlockEvent) -> None:
        self.apply(int(ev.kind), ev.key, ev.segment, ev.node_id, int(ev.tier))

    def drop_segment(self, segment: str) -> int:
        """Forget every block of a segment (its node is gone); returns how many."""
        bit = self._bits.get(segment)
        if bit is None or not self._blocks[bit]:
            return 0
        b = 1 << bit
        gone = [k for k, h in self._holders.items() if h & b]
        for k in gone:
            self.discard(k, bit)
        n = len(gone)
        # The table's keys all at once: each mask id with the bit becomes the id without it.
        ids = [i for i, m in enumerate(self._mask_of) if m & b and self._refs[i]]
        if ids:
            counts = self._table.counts(len(self._mask_of))
            new = np.arange(len(self._mask_of), dtype=np.int64)
            for i in ids:
                k = int(counts[i])
                m = self._mask_of[i] & ~b
                j = 0
                if m:
                    j = self._id(m)
                    self._refs[j] += k - 1
                new[i] = j
                self._release(i, k)
                n += k
            self._table.remap(new)
            self._blocks[bit] -= n - len(gone)
        return n

    def clear(self) -> None:
        self._holders.clear()
        self._masks.clear()
        self._table.clear()
        self._mask_of, self._id_of, self._refs, self._free_ids = [0], {0: 0}, [0], []
        self._blocks = [0] * len(self._names)
        self.clears += 1

    def __len__(self) -> int:
        return len(self._holders) + len(self._table)

    def holders(self, key: Hashable) -> list[str]:
        return [self._names[b] for b in _bits_of(self._get(key))]

    # -- the scheduler's question ----------------------------------------------------------

    def match(self, keys: Sequence[Hashable], masks: Sequence[int]) -> Match:
        """Prefix lengths of `keys`: anywhere, in DRAM, and per candidate mask.

        A candidate's local prefix is the longest run of leading blocks held by one of its
        segments (a prefix split across two of its segments counts up to the split; the rest
        is costed as a fetch). The walk runs at C speed: the holders of the keys up to the
        first miss (one batched table lookup for our block keys), their running AND; Python
        only visits the few points where the running AND loses bits, and only the candidates
        holding the first block (found through their segments' bits, not by testing each).

        `keys` may be a `blocktable.BlockKeys`, whose integers were decoded with the hashing;
        any other sequence is decoded here (a few microseconds for a long prompt).
        """
        hs, mask_of = self._prefix(keys)
        g = len(hs)
        local = [0] * len(masks)
        if not g:
            return Match(0, 0, local)
        # The distinct holders in order of first appearance (C speed; a prefix's blocks
        # mostly share a few masks). The running AND of the masks can only change where a
        # mask first appears, so it is computed over these few, not over every block.
        distinct = list(dict.fromkeys(hs))
        dmasks = distinct if mask_of is None else [mask_of[i] for i in distinct]
        first = dmasks[0]
        dram = g
        ssd = self.ssd_mask
        if ssd:
            # First block held only on SSD.
            not_ssd = ~ssd
            for t, m in zip(distinct, dmasks, strict=True):
                if not m & not_ssd:
                    dram = hs.index(t)
                    break
        # Candidates holding block 0 (any other has a local prefix of 0).
        holding = self._holding(first, masks)
        if not holding:
            return Match(g, dram, local)
        # (position, running AND from there on) at each change of the running AND.
        cuts = [(0, first)]
        a = first
        for t, m in zip(distinct, dmasks, strict=True):
            b = a & m
            if b != a:
                a = b
                cuts.append((hs.index(t), a))
                if not a:
                    break
        last = a
        for i in holding:
            m = masks[i]
            if m & last:
                local[i] = g
                continue
            for p, a in cuts:
                if not a & m:
                    local[i] = p
                    break
        return Match(g, dram, local, holding)

    def _prefix(self, keys: Sequence[Hashable]) -> tuple[list[int], list[int] | None]:
        """The holders of the leading keys held somewhere (up to the first miss): mask ids
        and the list that maps them to masks, or the masks themselves and None."""
        if type(keys) is blocktable.BlockKeys:
            words, probe = keys.words, keys.probe
        else:
            words, probe = blocktable.codes(keys) if keys else None, None
        if words is None or not len(words):
            if self._table.count:  # some keys may be the table's: ask per key
                return list(takewhile(int.__bool__, map(self._get, keys))), None
            return list(takewhile(int.__bool__, map(self._holders.get, keys, repeat(0)))), None
        held: list[int] = self._table.lookup(words, probe).tolist()
        if not all(held):  # a truth test per id, cheaper than `0 in held`'s comparisons
            del held[held.index(0):]
        return held, self._mask_of

    def _holding(self, first: int, masks: Sequence[int]) -> list[int]:
        """Indices of the candidates whose mask meets `first`, ascending.

        Through a map from segment bit to candidates, kept while the candidates' masks stay
        the same: a holder mask has a few bits, so this visits a few candidates instead of
        ANDing every candidate's mask."""
        if first.bit_count() > _FEW_BITS:
            return list(compress(range(len(masks)), map(first.__and__, masks)))
        if masks != self._cand_masks:
            by_bit: dict[int, list[int]] = {}
            for i, m in enumerate(masks):
                for b in _bits_of(m):
                    by_bit.setdefault(1 << b, []).append(i)
            self._cand_masks, self._by_bit = list(masks), by_bit
        out: list[int] = []
        lists = 0
        by_bit = self._by_bit
        m = first
        while m:
            low = m & -m
            c = by_bit.get(low)
            if c:
                out += c
                lists += 1
            m ^= low
        return sorted(set(out)) if lists > 1 else out


def _bits_of(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
