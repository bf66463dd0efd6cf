"""A hash table from 128-bit block keys to small ints whose lookups run in batches. Pure.

Why it exists: the KV index answers one question per request, for every block of the prompt at
once, and at a million keys a Python dict answers it one key at a time, each lookup a chain of
three dependent cache misses (index slot, entry, the stored key's string) plus TLB misses:
about half a microsecond per block, one after the other. Here the prompt's keys are decoded
once into an integer array and probed with a few numpy gathers, whose loads are independent,
so the CPU overlaps the misses of all the keys instead of paying them in series.

Keys are what `mooncake_k8s.common.blocks.block_keys` makes: 32 lowercase hex characters, read
as two little-endian int64 words `(a, b)`. Any other key is not this table's (`code` says so);
the index keeps those in a dict. The whole 128 bits are stored and compared, so two keys never
share an entry (no fingerprint collisions).

Layout: cuckoo hashing with two candidate slots per key (`a & mask`, `b & mask`; the words are
blake2b output, so both are uniform), one key per slot, load kept under `_MAX_LOAD` by doubling.
A lookup is then exactly two slots per key, with no probe loop and no tombstones: a deleted
entry is a slot whose value is 0. Single-key updates (store events) run in Python over a
memoryview of the same array.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

_MIN_SLOTS = 1 << 12
_MAX_LOAD = 0.45
"""Cuckoo hashing with two choices fills up to about half the slots before insertions start
to fail; doubling at 45% keeps kick chains short."""
_MAX_KICKS = 64


def code(key: object) -> tuple[int, int] | None:
    """The two words of a table key, or None when `key` is not a 32-lowercase-hex string, so
    that a key the table holds is never equal to one the dict holds."""
    if not isinstance(key, str) or len(key) != 32:
        return None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        return None
    # 16 bytes from 32 characters: no whitespace (which fromhex skips); then no upper case.
    if len(raw) != 16 or not (key.islower() or key.isdigit()):
        return None
    a, b = _WORDS.unpack(raw)
    return a, b


_WORDS = struct.Struct("<qq")


def codes(keys: Sequence[object]) -> npt.NDArray[np.int64] | None:
    """All keys' words as one flat array `[a0, b0, a1, b1, ...]`, or None unless every key is
    a table key. One join, one decode and one re-encode check the whole batch (the
    re-encoding, with a space every 16 bytes, equals the input only if each key is exactly 32
    lowercase hex characters)."""
    try:
        text = " ".join(keys)  # type: ignore[arg-type]  # a non-str key raises TypeError
        raw = bytes.fromhex(text)
    except (TypeError, ValueError):
        return None
    if raw.hex(" ", 16) != text:
        return None
    return np.frombuffer(raw, np.int64)


class BlockKeys(tuple[str, ...]):
    """A prompt's block keys, with their table words (`codes`) decoded once, where the keys
    are made: the router builds one per request next to `block_keys`, so the scheduler's
    lookup starts from integers. A tuple, so the words cannot go stale; a plain sequence of
    keys works everywhere too (decoded per lookup)."""

    words: npt.NDArray[np.int64] | None
    """None when not every key is a table key."""
    probe: npt.NDArray[np.bytes_] | None
    """`probe(words)`: what a lookup compares the slots with."""

    def __new__(cls, keys: Iterable[str]) -> BlockKeys:
        self = super().__new__(cls, keys)
        self.words = codes(self)
        self.probe = None if self.words is None else probe(self.words)
        return self


def probe(words: npt.NDArray[np.int64]) -> npt.NDArray[np.bytes_]:
    """Each key's 16 bytes, twice in a row: one per candidate slot, in the order of
    `words & mask` (the lookup's slots)."""
    return words.view("S16").repeat(2)


class BlockTable:
    """128-bit keys (as `code` words) -> positive ints; 0 means absent."""

    def __init__(self) -> None:
        self._reset(_MIN_SLOTS)

    def _reset(self, slots: int) -> None:
        self._mask = slots - 1
        self._rows = np.zeros((slots, 4), np.int64)
        """Slot s is row s: the key's two words, its value (0: the slot is free, its key
        stale), and padding to 32 bytes, so a probe reads one cache line (with the values in
        an array of their own, two: a 128-key lookup at a million keys took 12-17 us instead
        of 10 on the dev box)."""
        self._keys = self._rows.view("S16")
        """The same memory as (slots, 2) 16-byte items; column 0 is the key, which then
        compares in one operation (numpy ignores trailing NUL bytes in `S` comparisons; for
        items of one fixed size that still means equal bytes)."""
        self._values = self._rows[:, 2]
        self._w = self._rows.reshape(-1).data  # scalar access without numpy scalars
        self._grow_at = int(slots * _MAX_LOAD)
        self._stash: dict[tuple[int, int], int] = {}
        """Keys no slot can take in a table that is not crowded: only keys whose words
        collide with others' at every table size (crafted ones) end up here; doubling for
        them would never end."""
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def clear(self) -> None:
        self._reset(_MIN_SLOTS)

    # -- single keys (store events) --------------------------------------------------------

    def _find(self, a: int, b: int) -> int:
        """The slot holding key (a, b), or -1."""
        w = self._w
        r = (a & self._mask) << 2
        if w[r + 2] and w[r] == a and w[r + 1] == b:
            return r >> 2
        r = (b & self._mask) << 2
        if w[r + 2] and w[r] == a and w[r + 1] == b:
            return r >> 2
        return -1

    def find(self, a: int, b: int) -> int:
        """The slot holding key (a, b), or -1 (absent, or in the stash: ask `get`)."""
        return self._find(a, b)

    def value(self, slot: int) -> int:
        return self._w[4 * slot + 2]

    def assign(self, slot: int, value: int) -> None:
        """Set the value of a slot `find` gave; 0 deletes its key."""
        self._w[4 * slot + 2] = value
        self.count -= not value

    def get(self, a: int, b: int) -> int:
        s = self._find(a, b)
        if s >= 0:
            return self._w[4 * s + 2]
        return self._stash.get((a, b), 0) if self._stash else 0

    def set(self, a: int, b: int, value: int) -> None:
        """Set key (a, b) to `value`; 0 deletes it."""
        s = self._find(a, b)
        if s >= 0:
            self.assign(s, value)
        elif (a, b) in self._stash:
            if value:
                self._stash[a, b] = value
            else:
                del self._stash[a, b]
                self.count -= 1
        elif value:
            self.insert(a, b, value)

    def insert(self, a: int, b: int, value: int) -> None:
        """Add key (a, b), absent from the table and the stash, with a value > 0."""
        if self.count >= self._grow_at:
            self._grow()
        self._put(a, b, value)

    @property
    def stashed(self) -> int:
        """Keys in the stash (`find` does not see them; `get` and `set` do)."""
        return len(self._stash)

    def _put(self, a: int, b: int, value: int) -> None:
        left = self._place(a, b, value)
        while left is not None:
            if 4 * self.count < self._grow_at:
                self._stash[left[:2]] = left[2]
                break
            self._grow()
            left = self._place(*left)
        self.count += 1

    def _place(self, a: int, b: int, value: int) -> tuple[int, int, int] | None:
        """Cuckoo insertion. When a kick chain grows too long, the entry then in hand (maybe
        another key's) is returned, to be placed once the table has grown: none is lost."""
        w, mask = self._w, self._mask
        r = (a & mask) << 2
        if w[r + 2]:
            r2 = (b & mask) << 2
            if not w[r2 + 2]:
                r = r2
            else:
                for _ in range(_MAX_KICKS):
                    # Take row r; its key moves to its other slot.
                    oa, ob, ov = w[r], w[r + 1], w[r + 2]
                    w[r], w[r + 1], w[r + 2] = a, b, value
                    a, b, value = oa, ob, ov
                    s = r >> 2
                    r = ((b & mask) if (a & mask) == s else (a & mask)) << 2
                    if not w[r + 2]:
                        break
                else:
                    return a, b, value
        w[r], w[r + 1], w[r + 2] = a, b, value
        return None

    def _grow(self) -> None:
        """Double the slots and put every live key back: most in two vectorised passes (each
        key's first slot, then its second, where no other key claims it), the rest through
        `_place`. Rare (once per doubling) but not free: 0.15 s at half a million keys, 0.4 s
        at a million on the dev box, during which the event loop applies no event (the dict's
        own resizing at 1.4 million keys took 0.08 s)."""
        live = np.flatnonzero(self._values)
        words = self._rows[live, :2]
        values = self._values[live]
        stash = self._stash
        self._reset(2 * (self._mask + 1))
        left = np.ones(len(live), bool)
        for col in (0, 1):
            idx = np.flatnonzero(left)
            slots = words[idx, col] & self._mask
            free = self._values[slots] == 0
            idx, slots = idx[free], slots[free]
            slots, first = np.unique(slots, return_index=True)
            idx = idx[first]
            self._rows[slots, :2] = words[idx]
            self._values[slots] = values[idx]
            left[idx] = False
        self.count = len(live) - int(left.sum())
        for (a, b), value in zip(words[left].tolist(), values[left].tolist(), strict=True):
            self._put(a, b, value)
        for (a, b), value in stash.items():
            self._put(a, b, value)

    # -- batches (the scheduler's question) -------------------------------------------------

    def lookup(self, words: npt.NDArray[np.int64],
               keys: npt.NDArray[np.bytes_] | None = None) -> npt.NDArray[np.int64]:
        """Values of the keys in `words` (as `codes` makes it), 0 where absent; `keys` is
        `probe(words)` when the caller has it.

        Both candidate slots of every key are gathered at once (independent loads: the cache
        misses overlap); a slot counts only if its 16 bytes equal the key's, and a key is in at
        most one slot, so the larger of the two products is its value (both are, when its two
        candidate slots are one)."""
        slots = words & self._mask
        rows = self._keys.take(slots, axis=0)  # take: a third the time of rows[slots] here
        hit = rows[:, 0] == (probe(words) if keys is None else keys)
        got = rows.view(np.int64)[:, 2] * hit
        out: npt.NDArray[np.int64] = np.maximum(got[0::2], got[1::2])
        if self._stash:
            stash = self._stash
            for i, (a, b) in enumerate(words.reshape(-1, 2).tolist()):
                out[i] += stash.get((a, b), 0)
        return out

    def counts(self, size: int) -> npt.NDArray[np.int64]:
        """How many keys hold each value below `size` (a whole-table scan, for bulk edits)."""
        n = np.bincount(self._values, minlength=size)[:size]
        for value in self._stash.values():
            n[value] += 1
        return n

    def remap(self, new: npt.NDArray[np.int64]) -> None:
        """Replace every key's value v by new[v] at once (new[0] must be 0); keys mapped to 0
        are deleted."""
        self._values[:] = new[self._values]
        self.count = int(np.count_nonzero(self._values))
        for k, value in list(self._stash.items()):
            if new[value]:
                self._stash[k] = int(new[value])
            else:
                del self._stash[k]
        self.count += len(self._stash)
