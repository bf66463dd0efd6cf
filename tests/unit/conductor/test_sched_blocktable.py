"""The block-key table against a dict, and the index over it against the index over names.

Our own block keys (32 hex characters) live in `blocktable.BlockTable` and are looked up in
batches; every other key lives in a dict. Both must answer exactly alike, so the recorded
decisions (made with name keys) are replayed here with every key turned into a hex key.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Hashable, Iterator, Sequence

import numpy as np
import pytest

# This folder: pytest puts it on the path (mypy, run on all tests at once, does not).
import test_sched_recorded as recorded  # type: ignore[import-not-found]

from mooncake_k8s.conductor.sched import blocktable
from mooncake_k8s.conductor.sched.blocktable import BlockKeys, BlockTable, code, codes
from mooncake_k8s.conductor.sched.kvindex import DRAM, EVICTED, SPILLED, SSD, STORED, KVIndex, Match


def _hex(key: Hashable) -> str:
    """A block key standing for `key` (already one: itself, as `KVIndex.apply` calls `add`)."""
    if isinstance(key, str) and code(key) is not None:
        return key
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def test_only_lowercase_32_hex_strings_are_table_keys() -> None:
    good = "0123456789abcdef" * 2
    assert code(good) is not None and code("9" * 32) is not None
    for bad in ("0123456789ABCDEF" * 2, "0123456789abcdeF" * 2, good[:-1], good + "0",
                " " + good[1:], good[:16] + " " + good[17:], b"0" * 32, 7, ("x",)):
        assert code(bad) is None, bad
    assert codes([good, "9" * 32]) is not None
    for keys in ([good, "A" * 32], [good[:30], good + "ab"], [good, 5], [good + " "]):
        assert codes(keys) is None, keys
    w = codes([good, "f" * 32])
    assert w is not None and w.tolist() == [*code(good), *code("f" * 32)]  # type: ignore[misc]


def test_table_agrees_with_a_dict_under_random_updates() -> None:
    rng = random.Random(3)
    keys = [f"{rng.getrandbits(128):032x}" for _ in range(5000)]
    t, d = BlockTable(), {}
    for step in range(40_000):  # grows several times on the way
        k = rng.choice(keys)
        c = code(k)
        assert c is not None
        v = rng.randrange(1, 40) if rng.random() < 0.7 else 0
        t.set(*c, v)
        if v:
            d[k] = v
        else:
            d.pop(k, None)
        if step % 2000 == 0:
            q = rng.sample(keys, 200)
            w = codes(q)
            assert w is not None
            assert t.lookup(w).tolist() == [d.get(x, 0) for x in q]
            assert len(t) == len(d)
    counts = t.counts(40)
    assert counts[1:].tolist() == [list(d.values()).count(v) for v in range(1, 40)]
    new = np.arange(40, dtype=np.int64)
    new[5], new[6] = 0, 9
    t.remap(new)
    d = {k: int(new[v]) for k, v in d.items() if new[v]}
    w = codes(keys)
    assert w is not None and t.lookup(w).tolist() == [d.get(x, 0) for x in keys]
    assert len(t) == len(d)


def test_keys_that_collide_at_every_size_go_to_the_stash() -> None:
    # Both words of each key are 0 in every bit a table of any size uses: one slot for all.
    keys = ["0" * 32, "0" * 31 + "1", "0" * 30 + "10", "0" * 29 + "100", "0" * 15 + "1" + "0" * 16]
    t = BlockTable()
    for i, k in enumerate(keys):
        c = code(k)
        assert c is not None
        t.set(*c, i + 1)
    assert len(t) == len(keys) and t._stash  # the table did not double forever
    w = codes(keys)
    assert w is not None and t.lookup(w).tolist() == [1, 2, 3, 4, 5]
    c = code(keys[2])
    assert c is not None
    t.set(*c, 0)
    assert w is not None and t.lookup(w).tolist() == [1, 2, 0, 4, 5] and len(t) == 4
    new = np.arange(6, dtype=np.int64)
    new[4] = 0
    t.remap(new)
    assert t.lookup(w).tolist() == [1, 2, 0, 0, 5] and len(t) == 3


class HexIndex(KVIndex):
    """A KVIndex whose callers use names; it stores and asks for their hex keys."""

    def add(self, key: Hashable, bit: int) -> None:
        super().add(_hex(key), bit)

    def discard(self, key: Hashable, bit: int) -> None:
        super().discard(_hex(key), bit)

    def apply(self, kind: int, key: Hashable, segment: str, node_id: str = "",
              tier: int = DRAM) -> None:
        super().apply(kind, _hex(key), segment, node_id, tier)

    def holders(self, key: Hashable) -> list[str]:
        return super().holders(_hex(key))

    def match(self, keys: Sequence[Hashable], masks: Sequence[int]) -> Match:
        """Through `BlockKeys`, as the router asks."""
        return super().match(BlockKeys(_hex(k) for k in keys), masks)


def test_recorded_decisions_with_hex_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorded, "KVIndex", HexIndex)
    want = json.loads(recorded.RECORDING.read_text())
    assert json.loads(json.dumps(recorded.scenario())) == want


def _events(rng: random.Random, n: int) -> Iterator[tuple[int, str, str, str, int]]:
    segs = [("a-dram", "a", DRAM), ("b-dram", "b", DRAM), ("a-ssd", "a", SSD),
            ("pool-dram", "p", DRAM), ("c-dram", "c", DRAM)]
    for _ in range(n):
        seg, node, tier = rng.choice(segs)
        kind = rng.choice([STORED, STORED, STORED, EVICTED, SPILLED]) if tier == SSD else \
            rng.choice([STORED, STORED, EVICTED])
        yield kind, f"k{rng.randrange(60)}", seg, node, tier


def test_index_over_hex_keys_answers_as_over_names() -> None:
    rng = random.Random(11)
    names, hexes = KVIndex(), HexIndex()
    for ix in (names, hexes):
        for s in ("a-dram", "b-dram", "pool-dram", "c-dram"):
            ix.segment(s)
    masks = [names.mask(["a-dram", "a-ssd"]), names.mask(["b-dram"]), names.mask(["c-dram"]),
             names.mask(["b-dram", "c-dram"]), 0]
    assert masks == [hexes.mask(["a-dram", "a-ssd"]), hexes.mask(["b-dram"]),
                     hexes.mask(["c-dram"]), hexes.mask(["b-dram", "c-dram"]), 0]
    for step, ev in enumerate(_events(rng, 6000)):
        names.apply(*ev)
        hexes.apply(*ev)
        if step % 50 == 0:
            keys = [f"k{i}" for i in range(rng.randrange(0, 60))]
            want = names.match(keys, masks)
            assert hexes.match(keys, masks) == want
            assert KVIndex.match(hexes, [_hex(k) for k in keys], masks) == want  # plain keys
            k = f"k{rng.randrange(60)}"
            assert hexes.holders(k) == names.holders(k)
            assert len(hexes) == len(names)
        if step == 3000:
            assert hexes.drop_segment("b-dram") == names.drop_segment("b-dram")
    for s in ("a-dram", "b-dram", "a-ssd", "pool-dram", "c-dram"):
        assert hexes.blocks_in(s) == names.blocks_in(s)
        assert hexes.drop_segment(s) == names.drop_segment(s)
        assert len(hexes) == len(names)
    assert len(hexes) == 0


def test_a_batch_mixing_hex_and_other_keys_is_walked_key_by_key() -> None:
    ix = KVIndex()
    a = ix.segment("a")
    h = [_hex(i) for i in range(4)]
    for k in (h[0], "name", h[1], 42):
        ix.add(k, a)
    assert ix.match([h[0], "name", h[1], 42, h[2]], [1 << a]).local_blocks == [4]
    assert ix.match([h[0], h[1], h[2]], [1 << a]).global_blocks == 2
    assert blocktable.codes([h[0], "name"]) is None
