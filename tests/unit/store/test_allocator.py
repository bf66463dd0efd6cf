"""The segment allocator: best fit, alignment, coalescing, reservations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_k8s.store.master.allocator import ALIGN, SegmentAllocator, align_up


def test_alloc_aligns_and_accounts() -> None:
    a = SegmentAllocator(1000)
    assert a.capacity == 960  # rounded down to the alignment
    off = a.alloc(1)
    assert off == 0
    assert a.used == ALIGN and a.free_bytes == 960 - ALIGN
    off2 = a.alloc(65)
    assert off2 == 64 and a.size_of(off2) == 128
    assert all(o % ALIGN == 0 for o in (off, off2))
    a.check()


def test_alloc_returns_none_when_full_and_rejects_bad_sizes() -> None:
    a = SegmentAllocator(4096)
    assert a.alloc(4096) == 0
    assert a.alloc(1) is None
    with pytest.raises(ValueError):
        a.alloc(0)
    assert SegmentAllocator(0).alloc(1) is None


def test_best_fit_picks_the_smallest_hole() -> None:
    a = SegmentAllocator(64 * 100)
    offs = [a.alloc(64) for _ in range(100)]
    assert a.free_bytes == 0
    # holes of 3 blocks at 0..2, 1 block at 10, 2 blocks at 20..21
    for i in (0, 1, 2, 10, 20, 21):
        a.free(offs[i])  # type: ignore[arg-type]
    assert a.free_ranges == 3
    assert a.alloc(64) == 10 * 64  # the exact-size hole, not the first one
    assert a.alloc(128) == 20 * 64
    assert a.alloc(64 * 3) == 0
    a.check()


def test_free_coalesces_both_sides() -> None:
    a = SegmentAllocator(64 * 3)
    x, y, z = a.alloc(64), a.alloc(64), a.alloc(64)
    a.free(x)  # type: ignore[arg-type]
    a.free(z)  # type: ignore[arg-type]
    assert a.free_ranges == 2
    a.free(y)  # type: ignore[arg-type]
    assert a.free_ranges == 1 and a.largest_free == 64 * 3 and a.used == 0
    a.check()


def test_free_unknown_offset_raises() -> None:
    a = SegmentAllocator(4096)
    with pytest.raises(ValueError, match="no allocation"):
        a.free(0)
    off = a.alloc(100)
    a.free(off)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        a.free(off)  # type: ignore[arg-type]  # double free


def test_reserve_rebuilds_and_rejects_overlaps() -> None:
    a = SegmentAllocator(64 * 10)
    a.reserve(128, 100)  # occupies 128..255
    assert a.used == 128
    with pytest.raises(ValueError, match="overlaps"):
        a.reserve(192, 10)
    with pytest.raises(ValueError, match="overlaps"):
        a.reserve(64, 128)  # runs into the reserved range
    with pytest.raises(ValueError, match="aligned"):
        a.reserve(1, 10)
    with pytest.raises(ValueError, match="beyond"):
        a.reserve(64 * 9, 128)
    a.reserve(0, 64)
    a.reserve(64 * 9, 64)
    assert a.alloc(64 * 5) == 256
    assert a.alloc(64) == 64
    assert a.alloc(64) is None
    a.free(128)
    assert a.alloc(128) == 128
    a.check()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(min_value=1, max_value=5000), st.integers(0, 10**6)),
        max_size=200,
    )
)
def test_random_sequences_never_overlap_and_coalesce_back(
    ops: list[tuple[bool, int, int]],
) -> None:
    cap = 64 * 512
    a = SegmentAllocator(cap)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            off = a.alloc(size)
            if off is None:
                assert a.largest_free < align_up(size)
                continue
            end = off + align_up(size)
            assert end <= cap
            for o, n in live.items():
                assert end <= o or off >= o + n, "overlapping allocations"
            live[off] = align_up(size)
        else:
            off = sorted(live)[pick % len(live)]
            assert a.free(off) == live.pop(off)
        assert a.used == sum(live.values())
    a.check()
    for off in list(live):
        a.free(off)
    a.check()
    assert a.used == 0 and a.free_ranges == 1 and a.largest_free == cap


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 300)), max_size=40))
def test_reserve_random_ranges_match_a_bitmap(ranges: list[tuple[int, int]]) -> None:
    cap = 64 * 64
    a = SegmentAllocator(cap)
    taken = [False] * 64
    for block, size in ranges:
        blocks = align_up(size) // 64
        want_ok = block + blocks <= 64 and not any(taken[block : block + blocks])
        try:
            a.reserve(block * 64, size)
            ok = True
        except ValueError:
            ok = False
        assert ok == want_ok
        if ok:
            for i in range(block, block + blocks):
                taken[i] = True
    a.check()
    assert a.used == 64 * sum(taken)
