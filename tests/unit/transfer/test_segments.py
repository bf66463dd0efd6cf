"""Segments: shared-memory and file-backed regions, owners and peers, name validation."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mooncake_k8s.common.errors import InvalidArgument, TransferError
from mooncake_k8s.transfer import Segment, SegmentDesc, Tier
from mooncake_k8s.transfer.rdma import detect_rdma


def uniq(tag: str) -> str:
    return f"ut-{tag}-{os.getpid()}"


def test_shm_create_open_share_close() -> None:
    seg = Segment.create_shm(uniq("shm"), 1 << 20)
    try:
        assert seg.desc.tier == Tier.DRAM
        assert seg.desc.path == f"/dev/shm/mooncake-{uniq('shm')}"
        assert os.path.getsize(seg.desc.path) == 1 << 20
        assert len(seg.buf) == 1 << 20 and not seg.buf.readonly and seg.buf.format == "B"
        peer = Segment.open(seg.desc)
        seg.buf[100:105] = b"hello"
        assert bytes(peer.buf[100:105]) == b"hello"
        peer.buf[0:3] = b"abc"
        assert bytes(seg.buf[0:3]) == b"abc"
        ro = Segment.open(seg.desc, writable=False)
        assert ro.buf.readonly and bytes(ro.buf[0:3]) == b"abc"
        peer.close()
        peer.close()  # idempotent
        ro.close()
        assert os.path.exists(seg.desc.path), "a peer closing must not remove the file"
    finally:
        seg.close()
    assert seg.closed
    assert not os.path.exists(seg.desc.path), "the owner removes the file"
    seg.close()


def test_create_is_exclusive_and_replace_takes_only_a_dead_owners_file() -> None:
    seg = Segment.create_shm(uniq("excl"), 4096)
    try:
        with pytest.raises(InvalidArgument, match="already exists"):
            Segment.create_shm(uniq("excl"), 4096)
        with pytest.raises(InvalidArgument, match="held by a live process"):
            Segment.create_shm(uniq("excl"), 8192, replace=True)
        assert os.path.exists(seg.desc.path) and os.path.getsize(seg.desc.path) == 4096
    finally:
        seg.close()
    # A file no one holds (its owner died before removing it) is taken over.
    with open(seg.desc.path, "wb") as f:
        f.write(b"x" * 100)
    again = Segment.create_shm(uniq("excl"), 8192, replace=True)
    assert again.desc.size == 8192 and os.path.getsize(again.desc.path) == 8192
    again.close()
    assert not os.path.exists(again.desc.path)


def test_file_segment(tmp_path: Path) -> None:
    seg = Segment.create_file(uniq("ssd"), str(tmp_path), 3 * 4096)
    assert seg.desc.tier == Tier.SSD
    assert Path(seg.desc.path).parent == tmp_path
    np.frombuffer(seg.buf, dtype=np.uint8)[:] = 7
    peer = Segment.open(seg.desc)
    assert bytes(peer.buf[:4]) == b"\x07" * 4
    peer.close()
    seg.close()
    assert not os.path.exists(seg.desc.path)


def test_close_with_live_views_is_safe() -> None:
    seg = Segment.create_shm(uniq("views"), 4096)
    view = seg.buf[10:20]
    arr = np.frombuffer(seg.buf, dtype=np.uint8)
    seg.close()  # must not raise even though views exist
    assert not os.path.exists(seg.desc.path)
    view[0] = 1  # the mapping stays valid until the last view goes away
    assert arr[10] == 1
    del view, arr


@pytest.mark.parametrize("name", ["", "a" * 101, "a/b", "..\x00", "név", "a b", "x;rm"])
def test_invalid_names(name: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        SegmentDesc(name, Tier.DRAM, 10, "/dev/shm/x")
    with pytest.raises(InvalidArgument):
        Segment.create_shm(name, 4096)
    with pytest.raises(InvalidArgument):
        Segment.create_file(name, str(tmp_path), 4096)


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "x" * 100, "node-1-dram-0"])
def test_valid_names(name: str) -> None:
    assert SegmentDesc(name, Tier.DRAM, 10, "/p").name == name


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_invalid_sizes(size: object) -> None:
    with pytest.raises(InvalidArgument):
        Segment.create_shm(uniq("size"), size)  # type: ignore[arg-type]


def test_open_failures_are_transfer_errors(tmp_path: Path) -> None:
    missing = SegmentDesc(uniq("missing"), Tier.DRAM, 4096, f"/dev/shm/mooncake-{uniq('missing')}")
    with pytest.raises(TransferError, match="cannot open"):
        Segment.open(missing)
    seg = Segment.create_shm(uniq("small"), 4096)
    try:
        with pytest.raises(TransferError, match="expected 8192"):
            Segment.open(SegmentDesc(seg.desc.name, Tier.DRAM, 8192, seg.desc.path))
        # A descriptor cannot point the mapping at an arbitrary file.
        other = tmp_path / "passwd"
        other.write_bytes(b"x" * 4096)
        with pytest.raises(TransferError, match="is not"):
            Segment.open(SegmentDesc(seg.desc.name, Tier.DRAM, 4096, str(other)))
        with pytest.raises(TransferError, match="not a segment file"):
            Segment.open(SegmentDesc(seg.desc.name, Tier.SSD, 4096, str(other)))
    finally:
        seg.close()


def test_detect_rdma(tmp_path: Path) -> None:
    st = detect_rdma(str(tmp_path / "absent"))
    assert not st.available and "does not exist" in st.reason
    st = detect_rdma(str(tmp_path))
    assert not st.available and "no RDMA devices" in st.reason
    (tmp_path / "mlx5_0").mkdir()
    st = detect_rdma(str(tmp_path))
    assert st.devices == ("mlx5_0",)
    try:
        import pyverbs  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert not st.available and "pyverbs" in st.reason


def test_cluster_tag_keeps_same_named_segments_of_two_clusters_apart() -> None:
    name = uniq("tagged")
    a = Segment.create_shm(name, 4096, tag="0a1b2c3d")
    b = Segment.create_shm(name, 4096, tag="ffff0000", replace=True)  # must not take a's file
    try:
        assert a.desc.path == f"/dev/shm/mooncake-0a1b2c3d-{name}" != b.desc.path
        a.buf[:3] = b"abc"
        peer = Segment.open(a.desc)  # a tagged path is accepted by readers
        assert bytes(peer.buf[:3]) == b"abc"
        peer.close()
        for bad in ("XYZ", "0a1b2c3d0a1b2c3d0"):
            with pytest.raises(InvalidArgument):
                Segment.create_shm(name, 4096, tag=bad)
        forged = SegmentDesc(name, Tier.DRAM, 4096, f"/dev/shm/mooncake-zz-{name}")
        with pytest.raises(TransferError, match="cluster tag"):
            Segment.open(forged)
    finally:
        a.close()
        b.close()
