"""Real processes for the sidecar tests: a store cluster, and `mooncake sidecar` itself."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mooncake_k8s.sidecar.testing import SidecarProc, start_sidecar
from mooncake_k8s.store.testing import StoreCluster

TOKEN = "test-token"


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster(token=TOKEN) as c:
        c.start_master()
        c.start_node("a", "96MiB")
        yield c


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # short: a Unix socket path is limited to 107 bytes, pytest's tmp_path can be longer
    d = Path(tempfile.mkdtemp(prefix="mcsc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spawn_sidecar(cluster: StoreCluster, sockdir: Path) -> Iterator[Callable[..., SidecarProc]]:
    """Start `mooncake sidecar` (8 MiB staging in 4 slots) on a socket in `sockdir`."""
    procs: list[SidecarProc] = []

    def spawn(*extra: str, wait: bool = True) -> SidecarProc:
        proc = start_sidecar(
            str(sockdir / "sidecar.sock"), cluster.master_address, TOKEN,
            sockdir / f"sidecar-{len(procs)}.log", "--staging-size", "8MiB", "--slots", "4",
            *extra, wait=wait,
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        proc.kill(signal.SIGTERM)
