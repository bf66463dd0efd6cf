"""The P2P store's source as a real storage node process: killed with SIGKILL, or frozen
(SIGSTOP), in the middle of a fetch (issue 22 item 2).

The source node is a process of its own (it lives on this machine's real host id); the first
fetcher on emulated host hB keeps every chunk on its node there; the second fetcher, on hC,
loses the source after two chunks and must complete from hB with every byte verified.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_k8s.common.netutil import local_host_id
from mooncake_k8s.store.node.server import StorageNode
from mooncake_k8s.store.p2p import get, publish
from mooncake_k8s.store.testing import StoreCluster, start_host_node

MiB = 1 << 20
CHUNK = 256 << 10


@pytest.fixture
def bed() -> Iterator[tuple[StoreCluster, StorageNode]]:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("src", "16MiB")
        node = start_host_node(cluster, "nb", "hB", 16 * MiB)
        try:
            cluster.wait_nodes(2)
            yield cluster, node
        finally:
            node.stop()


def checkpoint(root: Path) -> Path:
    root.mkdir()
    for i in range(3):
        (root / f"shard-{i}.bin").write_bytes(os.urandom(3 * CHUNK + i))
    return root


@pytest.mark.parametrize("how", ["sigkill", "sigstop", "sigstop-suspect"])
def test_a_source_process_lost_mid_fetch_costs_retries_never_bytes(
        bed: tuple[StoreCluster, StorageNode], tmp_path: Path, how: str) -> None:
    cluster, _ = bed
    src = checkpoint(tmp_path / "src")
    with cluster.client(host_id=local_host_id()) as c:  # the source node's host
        man = publish(src, "ckpt", client=c, chunk_size=CHUNK)
    with cluster.client(host_id="hB") as b:
        first = get("ckpt", tmp_path / "b", client=b)
    assert first.counters.kept == len(man.chunks) == 11  # 3 + 4 + 4
    proc = cluster.nodes["src"]
    written: list[int] = []

    def lose_source(_index: int) -> None:
        written.append(_index)
        if len(written) == 2:
            if how == "sigkill":
                os.kill(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
            else:
                cluster.pause(proc)

    try:
        # suspect_s=0 tries the lost source again for every chunk it is asked first for; with
        # a suspect period it is asked once per fetch thread, then read last
        suspect = 30.0 if how.endswith("suspect") else 0.0
        with cluster.client(host_id="hC", attempt_timeout_s=0.5, suspect_s=suspect) as c:
            got = get("ckpt", tmp_path / "c", client=c, parallel=2, on_chunk=lose_source)
    finally:
        cluster.resume(proc)
    for f in src.iterdir():
        assert (tmp_path / "c" / f.name).read_bytes() == f.read_bytes(), f.name
    assert got.counters.failed_reads >= 1 and got.counters.corrupt == 0
    assert got.counters.by_host.get("hB", 0) >= len(man.chunks) - 2
    if suspect:
        assert got.counters.failed_reads <= 2  # parallel=2: at most one per fetch thread
