"""Space allocation inside one segment: best-fit over a coalescing free list.

The master never touches segment bytes; it only decides which byte ranges of a node's segment
an object occupies. Every range is aligned to `ALIGN` bytes (cache lines, and what O_DIRECT-ish
SSD paths like). Free ranges are indexed twice, by offset (to coalesce neighbours on free and to
find the range containing an offset on `reserve`) and by (size, offset) (best fit on alloc),
both sorted containers, so every operation is O(log n) in the number of free ranges.

An allocator either tracks its allocations (offset -> length, so `free(offset)` needs nothing
else) or, with `track=False`, only its free ranges: then the caller says how long the range it
frees is. The master builds untracked ones: it knows every object's size anyway, and a second
offset -> length map would cost it ~75 bytes per stored object (a dict slot and an int), a
quarter of its whole per-object budget. An untracked `free` still refuses a range that is
(partly) free already, so a double free is caught, not silently corrupting the free list.
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList

ALIGN = 64


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class SegmentAllocator:
    """Allocator for a segment of `size` bytes (usable capacity rounded down to `align`)."""

    __slots__ = ("_align", "_allocated", "_by_offset", "_by_size", "_count", "_used", "capacity")

    def __init__(self, size: int, align: int = ALIGN, track: bool = True) -> None:
        if size < 0:
            raise ValueError(f"segment size must be >= 0, got {size}")
        if align < 1 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        self._align = align
        self.capacity = size // align * align
        self._by_offset: SortedDict = SortedDict()  # offset -> length of the free range
        self._by_size: SortedList = SortedList()  # (length, offset) of every free range
        # offset -> rounded length; None when untracked (see the module docstring)
        self._allocated: dict[int, int] | None = {} if track else None
        self._count = 0
        self._used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    # -- queries ---------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes allocated (rounded up to the alignment)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        return int(self._by_size[-1][0]) if self._by_size else 0

    @property
    def allocations(self) -> int:
        return self._count

    @property
    def free_ranges(self) -> int:
        return len(self._by_offset)

    def rounded(self, size: int) -> int:
        return align_up(size, self._align)

    def size_of(self, offset: int) -> int | None:
        """The rounded length allocated at `offset`, or None (tracking allocators only)."""
        if self._allocated is None:
            raise ValueError("an untracked allocator does not know its allocations' lengths")
        return self._allocated.get(offset)

    # -- operations ------------------------------------------------------------------------

    def alloc(self, size: int) -> int | None:
        """Offset of a new range of at least `size` bytes, or None if no free range fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be >= 1, got {size}")
        need = align_up(size, self._align)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            return None
        length, offset = self._by_size[i]
        self._remove_free(offset, length)
        if length > need:
            self._add_free(offset + need, length - need)
        self._taken(offset, need)
        return int(offset)

    def reserve(self, offset: int, size: int) -> None:
        """Mark [offset, offset+size) allocated (rebuilding from an inventory).

        Raises ValueError when the range is misaligned, out of bounds, or overlaps anything
        already allocated.
        """
        if size <= 0:
            raise ValueError(f"reservation size must be >= 1, got {size}")
        if offset < 0 or offset % self._align:
            raise ValueError(f"offset {offset} is not aligned to {self._align}")
        need = align_up(size, self._align)
        if offset + need > self.capacity:
            raise ValueError(f"range {offset}+{size} is beyond the segment ({self.capacity})")
        i = self._by_offset.bisect_right(offset) - 1
        if i < 0:
            raise ValueError(f"range {offset}+{size} overlaps an allocated range")
        start, length = self._by_offset.peekitem(i)
        if start + length < offset + need:
            raise ValueError(f"range {offset}+{size} overlaps an allocated range")
        self._remove_free(start, length)
        if offset > start:
            self._add_free(start, offset - start)
        end = offset + need
        if start + length > end:
            self._add_free(end, start + length - end)
        self._taken(offset, need)

    def _taken(self, offset: int, need: int) -> None:
        if self._allocated is not None:
            self._allocated[offset] = need
        self._count += 1
        self._used += need

    def recount(self, delta: int) -> None:
        """Change the allocation count without touching any range: a space lease's extent is
        one allocation until objects are carved out of it (`spaces`)."""
        self._count += delta

    def free(self, offset: int, size: int | None = None, *, counted: bool = True) -> int:
        """Free the range allocated at `offset` (of `size` bytes, which an untracked allocator
        needs); returns its rounded length. `counted=False` frees an unused part of a larger
        allocation (an extent's gap), which the allocation count never included."""
        if self._allocated is None:
            if size is None:
                raise ValueError("an untracked allocator frees a range by offset and size")
            length = align_up(size, self._align)
            self._check_taken(offset, length)
        else:
            found = self._allocated.get(offset)
            if found is None:
                raise ValueError(f"no allocation at offset {offset}")
            if size is not None and align_up(size, self._align) != found:
                raise ValueError(f"the allocation at offset {offset} is {found} bytes, not {size}")
            del self._allocated[offset]
            length = found
        if counted:
            self._count -= 1
        self._used -= length
        start, end = offset, offset + length
        # Coalesce with the free range just before and just after.
        i = self._by_offset.bisect_left(offset)
        if i > 0:
            p_off, p_len = self._by_offset.peekitem(i - 1)
            if p_off + p_len == start:
                self._remove_free(p_off, p_len)
                start = p_off
        nxt = self._by_offset.get(end)
        if nxt is not None:
            self._remove_free(end, nxt)
            end += nxt
        self._add_free(start, end - start)
        return length

    def _check_taken(self, offset: int, length: int) -> None:
        """Raise unless [offset, offset+length) is in bounds and overlaps no free range."""
        if offset < 0 or offset % self._align or offset + length > self.capacity or length < 1:
            raise ValueError(f"no allocation at offset {offset} ({length} bytes)")
        i = self._by_offset.bisect_right(offset)
        if i > 0:
            p_off, p_len = self._by_offset.peekitem(i - 1)
            if p_off + p_len > offset:
                raise ValueError(f"no allocation at offset {offset}: the range is free")
        if i < len(self._by_offset) and self._by_offset.peekitem(i)[0] < offset + length:
            raise ValueError(f"no allocation at offset {offset}: part of the range is free")

    def _add_free(self, offset: int, length: int) -> None:
        self._by_offset[offset] = length
        self._by_size.add((length, offset))

    def _remove_free(self, offset: int, length: int) -> None:
        del self._by_offset[offset]
        self._by_size.remove((length, offset))

    def check(self) -> None:
        """Assert the internal invariants (tests)."""
        pos = 0
        free = [(o, n, "free") for o, n in self._by_offset.items()]
        if self._allocated is None:  # only the free ranges are known: the gaps are in use
            taken, end = [], 0
            for o, n, _ in free:
                if o > end:
                    taken.append((end, o - end, "used"))
                end = o + n
            if end < self.capacity:
                taken.append((end, self.capacity - end, "used"))
            assert self._used == sum(n for _, n, _ in taken), "used bytes disagree"
        else:
            taken = [(o, n, "used") for o, n in self._allocated.items()]
            assert self._used == sum(self._allocated.values())
            assert self._count == len(self._allocated)
        ranges = sorted(free + taken)
        prev_free = False
        for o, n, kind in ranges:
            assert o == pos, f"gap or overlap at {o} (expected {pos})"
            assert not (prev_free and kind == "free"), f"uncoalesced free ranges at {o}"
            prev_free = kind == "free"
            pos = o + n
        assert pos == self.capacity, f"ranges end at {pos}, capacity {self.capacity}"
        assert sorted((n, o) for o, n in self._by_offset.items()) == list(self._by_size)
