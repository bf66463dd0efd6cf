"""The RDMA transport's pure rules: remote lookup with bounds, work-request planning, path
negotiation. These decide where the NIC reads and writes, so they are checked exhaustively here
(no RDMA hardware is needed, or available)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_k8s.transfer import frames as fr
from mooncake_k8s.transfer.ops import TransferRejected
from mooncake_k8s.transfer.rdma_plan import (
    STAGE_ALIGN,
    Piece,
    RegionMap,
    buffer_address,
    gid_from_str,
    gid_to_str,
    negotiate,
    plan_rounds,
)

KiB, MiB = 1 << 10, 1 << 20


def regions() -> RegionMap:
    return RegionMap([fr.RdmaRegion("dram-0", 0x7F00_0000_0000, 0x1234, 64 * MiB),
                      fr.RdmaRegion("ssd-0", 0x7F10_0000_0000, 0x99, 4 * KiB)])


# -- lookup ------------------------------------------------------------------------------------


def test_locate_adds_the_offset_and_returns_the_segment_rkey() -> None:
    m = regions()
    assert m.locate("dram-0", 0, 1) == (0x7F00_0000_0000, 0x1234)
    assert m.locate("dram-0", 4096, 64 * MiB - 4096) == (0x7F00_0000_1000, 0x1234)
    assert m.locate("ssd-0", 4 * KiB, 0) == (0x7F10_0000_1000, 0x99)  # empty, at the end
    assert len(m) == 2 and "ssd-0" in m and "nope" not in m


@pytest.mark.parametrize(("name", "offset", "length", "code", "words"), [
    ("nope", 0, 1, fr.ST_UNKNOWN_SEGMENT, "not registered for RDMA"),
    ("ssd-0", 0, 4 * KiB + 1, fr.ST_OUT_OF_RANGE, "outside RDMA region 'ssd-0'"),
    ("ssd-0", 4 * KiB, 1, fr.ST_OUT_OF_RANGE, "[4096, 4097)"),
    ("ssd-0", -1, 2, fr.ST_OUT_OF_RANGE, "outside"),
    ("ssd-0", 10, -1, fr.ST_OUT_OF_RANGE, "outside"),
    ("dram-0", 2**63, 2**63, fr.ST_OUT_OF_RANGE, "outside"),
])
def test_locate_refuses_what_the_server_did_not_register(
        name: str, offset: int, length: int, code: int, words: str) -> None:
    with pytest.raises(TransferRejected) as e:
        regions().locate(name, offset, length)
    assert e.value.code == code and words in str(e.value)


def test_duplicate_region_names_are_refused() -> None:
    r = fr.RdmaRegion("a", 0x1000, 1, 10)
    with pytest.raises(ValueError, match="twice"):
        RegionMap([r, r])


# -- planning ----------------------------------------------------------------------------------


def test_small_ops_share_one_round_in_order() -> None:
    rounds = plan_rounds([(100, 0x1000, 7), (0, 0, 0), (200, 0x9000, 8)],
                         max_message=1 << 30, max_outstanding=64, stage_bytes=MiB)
    assert rounds == [[Piece(0, 0, 100, 0x1000, 7, 0),
                       Piece(2, 0, 200, 0x9000, 8, 128)]]  # 100 rounded up to 64-byte lines


def test_an_op_larger_than_the_largest_message_is_split() -> None:
    rounds = plan_rounds([(10 * KiB, 0x10000, 5)], max_message=4 * KiB, max_outstanding=64,
                         stage_bytes=MiB)
    assert [(p.op_offset, p.length, p.remote_addr, p.stage_offset) for p in rounds[0]] == [
        (0, 4096, 0x10000, 0), (4096, 4096, 0x11000, 4096), (8192, 2048, 0x12000, 8192)]


def test_outstanding_limit_starts_a_new_round_reusing_the_staging_buffer() -> None:
    rounds = plan_rounds([(64, 0x1000 * i, 1) for i in range(5)], max_message=MiB,
                         max_outstanding=2, stage_bytes=MiB)
    assert [len(r) for r in rounds] == [2, 2, 1]
    assert [[p.stage_offset for p in r] for r in rounds] == [[0, 64], [0, 64], [0]]


def test_staging_capacity_bounds_a_round_and_a_piece() -> None:
    rounds = plan_rounds([(3 * KiB, 0x1000, 1), (3 * KiB, 0x9000, 2)], max_message=1 << 30,
                         max_outstanding=64, stage_bytes=4 * KiB)
    pieces = [(p.op_index, p.op_offset, p.length, p.stage_offset) for r in rounds for p in r]
    assert pieces == [(0, 0, 3072, 0), (1, 0, 3072, 0)]
    assert len(rounds) == 2
    rounds = plan_rounds([(9 * KiB, 0x1000, 1)], max_message=1 << 30, max_outstanding=64,
                         stage_bytes=4 * KiB)
    assert [[(p.op_offset, p.length) for p in r] for r in rounds] == [
        [(0, 4096)], [(4096, 4096)], [(8192, 1024)]]


@pytest.mark.parametrize("bad", [
    {"max_message": 0}, {"max_outstanding": 0}, {"stage_bytes": 0},
])
def test_nonpositive_limits_are_refused(bad: dict[str, int]) -> None:
    limits = {"max_message": 1, "max_outstanding": 1, "stage_bytes": 1} | bad
    with pytest.raises(ValueError, match="positive limits"):
        plan_rounds([(1, 0, 0)], **limits)


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        plan_rounds([(-1, 0, 0)], max_message=1, max_outstanding=1, stage_bytes=1)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 50_000), max_size=30),
       max_message=st.integers(1, 20_000), max_outstanding=st.integers(1, 9),
       stage_bytes=st.integers(1, 70_000))
def test_plan_covers_every_byte_once_within_every_limit(
        lengths: list[int], max_message: int, max_outstanding: int, stage_bytes: int) -> None:
    targets = [(n, 1_000_000 * (i + 1), i) for i, n in enumerate(lengths)]
    rounds = plan_rounds(targets, max_message=max_message, max_outstanding=max_outstanding,
                         stage_bytes=stage_bytes)
    seen: dict[int, int] = {}
    for rnd in rounds:
        assert 1 <= len(rnd) <= max_outstanding
        spans = sorted((p.stage_offset, p.stage_offset + p.length) for p in rnd)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start  # no two pieces of a round share staging bytes
        for p in rnd:
            assert 0 < p.length <= min(max_message, stage_bytes)
            assert p.stage_offset % STAGE_ALIGN == 0
            assert p.stage_offset + p.length <= stage_bytes
            _n, addr, rkey = targets[p.op_index]
            assert (p.remote_addr, p.rkey) == (addr + p.op_offset, rkey)
            assert seen.get(p.op_index, 0) == p.op_offset  # in order, no gap, no overlap
            seen[p.op_index] = p.op_offset + p.length
    assert seen == {i: n for i, n in enumerate(lengths) if n}


# -- negotiation and small helpers ---------------------------------------------------------------


def endpoint(mtu: int, max_message: int, rd_atomic: int) -> fr.RdmaEndpoint:
    return fr.RdmaEndpoint(1, 2, 3, bytes(16), mtu, rd_atomic, max_message)


def test_negotiate_takes_the_lesser_of_each_limit() -> None:
    p = negotiate(endpoint(5, 1 << 31, 16), endpoint(3, 1 << 30, 4))
    assert (p.mtu, p.max_message, p.rd_atomic) == (3, 1 << 30, 4)
    p = negotiate(endpoint(1, 0, 0), endpoint(5, 0, 0))
    assert (p.mtu, p.max_message, p.rd_atomic) == (1, 1, 1)


def test_gid_text_round_trip() -> None:
    raw = bytes.fromhex("fe800000000000000202c9fffe000001")
    text = gid_to_str(raw)
    assert text == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    assert gid_from_str(text) == raw
    with pytest.raises(ValueError):
        gid_to_str(b"\x00" * 4)
    with pytest.raises(ValueError):
        gid_from_str("fe80::1")


def test_buffer_address_points_at_the_first_byte() -> None:
    arr = np.arange(100, dtype=np.uint8)
    view = arr.data
    assert buffer_address(view) == arr.ctypes.data
    assert buffer_address(view[10:]) == arr.ctypes.data + 10
    assert buffer_address(memoryview(bytes(8))) > 0  # read-only buffers have one too
    with pytest.raises(ValueError, match="empty"):
        buffer_address(view[:0])
    with pytest.raises(ValueError, match="contiguous"):
        buffer_address(np.zeros((4, 4), np.uint8)[:, 1].data)
