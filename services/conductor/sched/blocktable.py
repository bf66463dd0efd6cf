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
entry is a slot whose value is 0. Single-key updates (store events) run in Python over
memoryviews of the same arrays.
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

    def __new__(cls, keys: Iterable[str]) -> BlockKeys:
        self = super().__new__(cls, keys)
        self.words = codes(self)
        return self


class BlockTable:
    """128-bit keys (as `code` words) -> positive ints; 0 means absent."""

    def __init__(self) -> None:
        self._reset(_MIN_SLOTS)

    def _reset(self, slots: int) -> None:
        self._mask = slots - 1
        self._words = np.zeros(2 * slots, np.int64)
        """Slot s holds the key (words[2s], words[2s+1]); stale once its value is 0."""
        self._keys = self._words.view("S16")
        """The same memory, one 16-byte item per slot: a key compares in one operation
        (numpy ignores trailing NUL bytes in `S` comparisons; for items of one fixed size
        that still means equal bytes)."""
        self._values = np.zeros(slots, np.int64)
        self._w = self._words.data  # memoryviews: scalar access without numpy scalars
        self._v = self._values.data
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
        w, v = self._w, self._v
        s = a & self._mask
        if v[s] and w[2 * s] == a and w[2 * s + 1] == b:
            return s
        s = b & self._mask
        if v[s] and w[2 * s] == a and w[2 * s + 1] == b:
            return s
        return -1

    def find(self, a: int, b: int) -> int:
        """The slot holding key (a, b), or -1 (absent, or in the stash: ask `get`)."""
        return self._find(a, b)

    def value(self, slot: int) -> int:
        return self._v[slot]

    def assign(self, slot: int, value: int) -> None:
        """Set the value of a slot `find` gave; 0 deletes its key."""
        self._v[slot] = value
        self.count -= not value

    def get(self, a: int, b: int) -> int:
        s = self._find(a, b)
        if s >= 0:
            return self._v[s]
        return self._stash.get((a, b), 0) if self._stash else 0

    def set(self, a: int, b: int, value: int) -> None:
        """Set key (a, b) to `value`; 0 deletes it."""
        s = self._find(a, b)
        if s >= 0:
            self._v[s] = value
            self.count -= not value
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
        w, v, mask = self._w, self._v, self._mask
        s = a & mask
        if v[s]:
            s2 = b & mask
            if not v[s2]:
                s = s2
            else:
                for _ in range(_MAX_KICKS):
                    # Take slot s; its key moves to its other slot.
                    oa, ob, ov = w[2 * s], w[2 * s + 1], v[s]
                    w[2 * s], w[2 * s + 1], v[s] = a, b, value
                    a, b, value = oa, ob, ov
                    s = (b & mask) if (a & mask) == s else (a & mask)
                    if not v[s]:
                        break
                else:
                    return a, b, value
        w[2 * s], w[2 * s + 1], v[s] = a, b, value
        return None

    def _grow(self) -> None:
        """Double the slots and put every live key back: most in two vectorised passes (each
        key's first slot, then its second, where no other key claims it), the rest through
        `_place`."""
        live = np.flatnonzero(self._values)
        words = self._words.reshape(-1, 2)[live]
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
            self._words.reshape(-1, 2)[slots] = words[idx]
            self._values[slots] = values[idx]
            left[idx] = False
        self.count = len(live) - int(left.sum())
        for (a, b), value in zip(words[left].tolist(), values[left].tolist(), strict=True):
            self._put(a, b, value)
        for (a, b), value in stash.items():
            self._put(a, b, value)

    # -- batches (the scheduler's question) -------------------------------------------------

    def lookup(self, words: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Values of the keys in `words` (as `codes` makes it), 0 where absent.

        Both candidate slots of every key are gathered at once (independent loads: the cache
        misses overlap); a slot counts only if its 16 bytes equal the key's, and a key is in at
        most one slot, so the larger of the two products is its value (both are, when its two
        candidate slots are one)."""
        slots = words & self._mask
        hit = self._keys[slots] == words.view("S16").repeat(2)
        got = self._values[slots] * hit
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
