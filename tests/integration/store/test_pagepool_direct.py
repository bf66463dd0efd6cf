"""`DirectPagePool` against a real master and node: pages of scattered regions (numpy and torch
CPU memory, viewed by address as an engine hands them over) go in and come back byte-exact;
every kind of bad object is a miss that leaves the caller's memory untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.store.client import pagepool as pp
from mooncake_k8s.store.client.pagepool import DirectPagePool, PagePool, PoolUnavailable
from mooncake_k8s.store.testing import StoreCluster

KiB = 1 << 10
REGIONS = 60


class Pages:
    """`n` pages of REGIONS regions each, scattered (with gaps) through one numpy buffer."""

    def __init__(self, n: int, region: int, fill: int | None = None, seed: int = 0) -> None:
        self.n, self.region = n, region
        self.buf = np.zeros(n * REGIONS * region * 2, dtype=np.uint8)
        if fill is None:
            self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.buf.size)
        else:
            self.buf[:] = fill
        self.base = self.buf.ctypes.data

    def regions(self, i: int) -> list[tuple[int, int]]:
        # region j of page i lives at slot (j * n + i) * 2: pages interleave, gaps between
        return [(self.base + ((j * self.n + i) * 2) * self.region, self.region)
                for j in range(REGIONS)]

    def all(self) -> list[list[tuple[int, int]]]:
        return [self.regions(i) for i in range(self.n)]

    def content(self, i: int) -> bytes:
        return b"".join(self.buf[a - self.base : a - self.base + n].tobytes()
                        for a, n in self.regions(i))


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("a", "96MiB")
        yield c


@pytest.fixture
def pool(cluster: StoreCluster) -> Iterator[DirectPagePool]:
    with DirectPagePool(cluster.master_address, cluster.token) as p:
        yield p


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_round_trip_scattered_pages(cluster: StoreCluster, transport: str) -> None:
    with DirectPagePool(cluster.master_address, cluster.token, transport) as pool:
        assert isinstance(pool, PagePool)
        src = Pages(8, 512, seed=1)
        keys = [f"rt-{transport}-{i}" for i in range(8)]
        assert pool.put_pages(keys, src.all()) == [True] * 8
        dst = Pages(8, 512, fill=0)
        assert pool.get_pages(keys, dst.all()) == [True] * 8
        for i in range(8):
            assert dst.content(i) == src.content(i)
        # the gaps between regions are untouched
        assert not dst.buf.reshape(-1, 512)[1::2].any()


def test_torch_pages_and_existing_key(pool: DirectPagePool) -> None:
    src = torch.arange(4 * 4096, dtype=torch.int32).reshape(4, 4096)
    pages = [[(src[i].data_ptr(), 2048 * 4), (src[i, 2048:].data_ptr(), 2048 * 4)]
             for i in range(4)]
    keys = [f"torch-{i}" for i in range(4)]
    assert pool.put_pages(keys, pages) == [True] * 4
    assert pool.put_pages(keys, pages) == [True] * 4  # already stored counts as stored
    dst = torch.zeros_like(src)
    out = [[(dst[i].data_ptr(), 4096 * 4)] for i in range(4)]  # one region: layout-free
    assert pool.get_pages(keys, out) == [True] * 4
    assert torch.equal(dst, src)


def test_prefix_exists(pool: DirectPagePool) -> None:
    src = Pages(3, 64, seed=2)
    keys = ["pre-0", "pre-1", "pre-2"]
    assert pool.put_pages(keys, src.all()) == [True] * 3
    assert pool.prefix_exists([*keys, "pre-missing", "pre-0"]) == 3
    assert pool.prefix_exists(["pre-missing", *keys]) == 0
    assert pool.prefix_exists(keys[:2]) == 2
    assert pool.prefix_exists([]) == 0


def test_misses_leave_memory_untouched(cluster: StoreCluster, pool: DirectPagePool) -> None:
    src = Pages(2, 256, seed=3)
    assert pool.put_pages(["miss-a", "miss-b"], src.all()) == [True, True]
    # a raw object of the right total size but without our header
    with cluster.client() as c:
        c.put("miss-raw", np.full(pp.HEADER_SIZE + REGIONS * 256, 7, dtype=np.uint8))
    small, same, big = Pages(1, 128, fill=0xAB), Pages(3, 256, fill=0xAB), Pages(1, 512, fill=0xAB)
    assert pool.get_pages(["miss-a"], small.all()) == [False]  # object larger than the page
    assert pool.get_pages(["miss-a"], big.all()) == [False]  # object smaller than the page
    ok = pool.get_pages(["miss-a", "nope", "miss-raw"], same.all())
    assert ok == [True, False, False]
    assert same.content(0) == src.content(0)
    for pages in (small, big):
        assert (pages.buf == 0xAB).all()
    assert set(same.content(1)) == {0xAB} and set(same.content(2)) == {0xAB}


def test_a_page_altered_after_it_was_sealed_is_a_miss(cluster: StoreCluster,
                                                      pool: DirectPagePool) -> None:
    """Header intact, one payload byte flipped (as a buggy or hostile writer would store it):
    the store's own checksum is of the altered object, so only the page's seal catches it."""
    src = Pages(1, 256, seed=5)
    assert pool.put_pages(["sealed"], src.all()) == [True]
    with cluster.client() as c:
        obj = bytearray(c.get("sealed"))
        obj[pp.HEADER_SIZE + 1000] ^= 0x01
        c.remove(["sealed"], force=True)
        c.put("sealed", obj)
    dst = Pages(1, 256, fill=0xAB)
    assert pool.get_pages(["sealed"], dst.all()) == [False]
    assert (dst.buf == 0xAB).all()


def test_chunked_batches(monkeypatch: pytest.MonkeyPatch, pool: DirectPagePool) -> None:
    monkeypatch.setattr(pp, "CHUNK_BYTES", 40 * KiB)  # ~2 pages a round trip
    src = Pages(7, 256, seed=4)  # 15 KiB pages
    keys = [f"chunk-{i}" for i in range(7)]
    assert pool.put_pages(keys, src.all()) == [True] * 7
    dst = Pages(7, 256, fill=0)
    assert pool.get_pages([*keys[:3], "chunk-x", *keys[3:]], [*dst.all()[:3], Pages(1, 256,
                          fill=0).regions(0), *dst.all()[3:]]) == [True] * 3 + [False] + [True] * 4
    for i in range(7):
        assert dst.content(i) == src.content(i)


@pytest.mark.parametrize(("keys", "pages", "match"), [
    (["a", "b"], [[(4096, 1)]], "2 keys but 1 pages"),
    (["a"], [[(0, 16)]], "positive int address"),
    (["a"], [[(4096, -1)]], "non-negative"),
    (["a"], [[(4096, 1.5)]], "int size"),
    (["a"], [[(4096,)]], "is not \\(ptr, nbytes\\)"),
    (["a"], [[]], "has no bytes"),
    ([""], [[(4096, 1)]], "non-empty string"),
    ("ab", [[(4096, 1)], [(4096, 1)]], "not one string"),
])
def test_bad_input_is_typed(pool: DirectPagePool, keys, pages, match) -> None:
    for call in (pool.put_pages, pool.get_pages):
        with pytest.raises(InvalidArgument, match=match):
            call(keys, pages)


def test_dead_pool_raises_typed_and_bounded() -> None:
    with DirectPagePool(f"127.0.0.1:{free_port()}", "t", timeout_s=0.5) as pool:
        page = Pages(1, 64, fill=1)
        t0 = time.monotonic()
        assert pool.put_pages(["k"], page.all()) == [False]
        with pytest.raises(PoolUnavailable):
            pool.get_pages(["k"], page.all())
        with pytest.raises(PoolUnavailable):
            pool.prefix_exists(["k"])
        assert time.monotonic() - t0 < 5
        assert (page.buf == 1).all()
