"""The transfer sidecar as a real process between real clients and a real store: pages round
trip between two client processes, the socket is private, and a sidecar killed (-9) under load
costs misses for a moment, never wrong bytes or a hang."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_k8s.common.errors import AuthError
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.sidecar.client import SidecarPagePool
from mooncake_k8s.sidecar.testing import Pages, SidecarProc, page_bytes
from mooncake_k8s.store.client.pagepool import DirectPagePool, PagePool, PoolUnavailable
from mooncake_k8s.store.testing import StoreCluster

pytestmark = pytest.mark.timeout(120)
TOKEN = "test-token"  # conftest's cluster token
HERE = Path(__file__).parent
PAGE = 60 * 512  # 30 KiB in 60 regions
Spawn = Callable[..., SidecarProc]


def run_client(sock: str, *args: object) -> dict[str, list[bool]]:
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, str(HERE / "sidecar_client_proc.py"), sock, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    result: dict[str, list[bool]] = json.loads(out.stdout)
    return result


def test_round_trip_between_client_processes(spawn_sidecar: Spawn,
                                             cluster: StoreCluster) -> None:
    sc = spawn_sidecar()
    assert run_client(sc.socket, "put", "xproc", 6, PAGE, 11) == {"ok": [True] * 6}
    # a second process reads them back through the sidecar ...
    got = run_client(sc.socket, "get", "xproc", 6, PAGE, 11)
    assert got == {"ok": [True] * 6, "match": [True] * 6}
    # ... and this one too, both through the sidecar and in-process: one object format
    keys = [f"xproc-{i}" for i in range(6)]
    for pool in (SidecarPagePool(sc.socket, TOKEN), DirectPagePool(cluster.master_address, TOKEN)):
        with pool:
            assert isinstance(pool, PagePool)
            dst = Pages(6, PAGE, fill=0)
            assert pool.get_pages(keys, dst.all()) == [True] * 6
            for i in range(6):
                assert np.array_equal(dst.content(i), page_bytes(11, i, PAGE))
    # a page put in-process reads back through the sidecar
    src = Pages(1, PAGE)
    src.fill_from(12, 0)
    with DirectPagePool(cluster.master_address, TOKEN) as direct:
        assert direct.put_pages(["direct-0"], src.all()) == [True]
    dst = Pages(1, PAGE, fill=0)
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        assert pool.get_pages(["direct-0"], dst.all()) == [True]
    assert np.array_equal(dst.content(0), page_bytes(12, 0, PAGE))


def test_prefix_exists_misses_and_batches_larger_than_a_slot(spawn_sidecar: Spawn) -> None:
    sc = spawn_sidecar()  # 8 MiB staging in 4 slots: ~2 MiB a slot
    n, size = 90, 60 * 1024  # 5.3 MiB: three requests
    src = Pages(n, size)
    for i in range(n):
        src.fill_from(21, i)
    keys = [f"big-{i}" for i in range(n)]
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        assert pool.put_pages(keys, src.all()) == [True] * n
        assert pool.put_pages(keys[:2], src.all()[:2]) == [True, True]  # exists: stored
        assert pool.prefix_exists([*keys, "big-missing", keys[0]]) == n
        assert pool.prefix_exists(["big-missing", *keys]) == 0
        dst = Pages(n + 1, size, fill=0xAB)
        ok = pool.get_pages([*keys[:45], "big-missing", *keys[45:]], dst.all())
        assert ok == [True] * 45 + [False] + [True] * 45
        for i in range(n + 1):
            if i == 45:
                assert (dst.content(i) == 0xAB).all()  # a miss leaves the page alone
            else:
                assert np.array_equal(dst.content(i), page_bytes(21, i if i < 45 else i - 1,
                                                                  size))
        # a page larger than a slot is a miss; its neighbours still move
        huge = np.zeros(3 << 20, dtype=np.uint8)
        pages = [src.regions(0), [(huge.ctypes.data, huge.size)], src.regions(1)]
        assert pool.put_pages(["huge-a", "huge-b", "huge-c"], pages) == [True, False, True]
        stats = pool.stats()
    assert stats["pages_put"] >= n + 4 and stats["pages_missed"] >= 1
    assert stats["ops_put"] >= 3 and stats["bytes_got"] == n * size


def test_socket_and_staging_are_private(spawn_sidecar: Spawn) -> None:
    sc = spawn_sidecar()
    st = os.stat(sc.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(sc.socket).parent).st_mode) & 0o077 == 0
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        stats = pool.stats()
    assert stats["staging_bytes"] == 8 << 20 and stats["slots"] == 4
    staging = [ln for ln in sc.log().splitlines() if "sidecar serving" in ln]
    assert staging, sc.log()
    shm = [f for f in os.listdir("/dev/shm") if f.startswith("mooncake-sidecar-")]
    assert shm and all(stat.S_IMODE(os.stat(f"/dev/shm/{f}").st_mode) == 0o600 for f in shm)
    assert TOKEN not in sc.log()


def test_wrong_token_is_an_auth_error(spawn_sidecar: Spawn) -> None:
    sc = spawn_sidecar()
    with pytest.raises(AuthError):
        SidecarPagePool(sc.socket, "not-the-token")


def test_live_socket_is_not_stolen(spawn_sidecar: Spawn) -> None:
    sc = spawn_sidecar()
    second = spawn_sidecar(wait=False)
    assert second.popen.wait(timeout=30) != 0
    assert "another sidecar is serving" in second.log()
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        assert pool.stats()["slots"] == 4


def test_client_before_sidecar_then_sidecar_killed_and_restarted_under_load(
    spawn_sidecar: Spawn,
) -> None:
    """The whole outage story with a client thread hammering puts and gets."""
    seed, n, size = 31, 8, PAGE
    first = spawn_sidecar(wait=False)
    pool = SidecarPagePool(first.socket, TOKEN, timeout_s=2.0)  # may start before the sidecar
    first.wait_ready()
    keys = [f"load-{i}" for i in range(n)]
    src = Pages(n, size)
    for i in range(n):
        src.fill_from(seed, i)
    stop = threading.Event()
    wrong: list[str] = []
    ok_after: list[tuple[float, float]] = []  # (start, end) of fully successful rounds
    slow: list[float] = []
    ops = [0]

    def hammer() -> None:
        dst = Pages(n, size)
        while not stop.is_set():
            t0 = time.monotonic()
            put = pool.put_pages(keys, src.all())
            dst.buf[:] = 0x5A
            got = pool.get_pages(keys, dst.all())
            took = time.monotonic() - t0
            if took > 2.5:
                slow.append(took)
            for i, good in enumerate(got):
                if good and not np.array_equal(dst.content(i), page_bytes(seed, i, size)):
                    wrong.append(keys[i])
                if not good and not (dst.content(i) == 0x5A).all():
                    wrong.append(f"{keys[i]} (miss, but its memory was written)")
            if all(got) and all(put):
                ok_after.append((t0, time.monotonic()))
            ops[0] += 1

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        assert ok_after, "no successful round trip before the kill"
        first.kill()  # -9: no goodbye, the socket file and the staging file stay behind
        killed_at = time.monotonic()
        time.sleep(1.0)
        # while down: misses and 0, quickly
        probe = Pages(1, size, fill=0x11)
        t0 = time.monotonic()
        assert pool.get_pages(keys[:1], probe.all()) == [False]
        assert pool.prefix_exists(keys) == 0
        assert pool.put_pages(keys[:1], src.all()[:1]) == [False]
        assert time.monotonic() - t0 < 0.5
        assert (probe.buf == 0x11).all()
        spawn_at = time.monotonic()
        second = spawn_sidecar()  # same socket path, same staging name
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(s > spawn_at for s, _ in ok_after):
            time.sleep(0.05)
        assert any(s > spawn_at for s, _ in ok_after), "client never recovered"
        assert not any(killed_at < s and e < spawn_at for s, e in ok_after)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not wrong, wrong
    assert not slow, slow
    assert pool.counters["broken"] >= 1 and pool.counters["connects"] >= 2 and ops[0] > 10
    # the restarted sidecar serves what was stored before the kill
    dst = Pages(n, size, fill=0)
    assert pool.get_pages(keys, dst.all()) == [True] * n
    assert all(np.array_equal(dst.content(i), page_bytes(seed, i, size)) for i in range(n))
    pool.close()
    assert second.popen.poll() is None


def test_store_down_behind_a_live_sidecar(spawn_sidecar: Spawn) -> None:
    """The sidecar is up but its master is not: reads raise the typed error (as the
    in-process pool does), writes are just not saved, and nothing waits past the bound."""
    sc = spawn_sidecar("--master", f"127.0.0.1:{free_port()}", "--store-timeout-s", "0.5")
    page = Pages(1, PAGE, fill=0x22)
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        t0 = time.monotonic()
        assert pool.put_pages(["dead-0"], page.all()) == [False]
        with pytest.raises(PoolUnavailable):
            pool.get_pages(["dead-0"], page.all())
        with pytest.raises(PoolUnavailable):
            pool.prefix_exists(["dead-0"])
        assert time.monotonic() - t0 < 6
        assert pool.stats()["errors_pool_unavailable"] >= 2  # the connection survived
    assert (page.buf == 0x22).all()


def test_restart_between_calls_is_retried_within_the_call(spawn_sidecar: Spawn) -> None:
    """A connection broken by a restart is noticed on use; the same call reconnects, maps the
    new staging segment and succeeds (no miss for the caller)."""
    sc = spawn_sidecar()
    src = Pages(3, PAGE)
    for i in range(3):
        src.fill_from(41, i)
    keys = [f"retry-{i}" for i in range(3)]
    with SidecarPagePool(sc.socket, TOKEN, connections=1) as pool:
        assert pool.put_pages(keys, src.all()) == [True] * 3
        before = pool.stats()["incarnation"]
        sc.kill()
        spawn_sidecar()
        dst = Pages(3, PAGE, fill=0)
        assert pool.get_pages(keys, dst.all()) == [True] * 3
        assert all(np.array_equal(dst.content(i), page_bytes(41, i, PAGE)) for i in range(3))
        assert pool.counters["broken"] == 1 and pool.counters["connects"] == 2
        assert pool.stats()["incarnation"] != before
