"""The P2P store (issue 22 item 2) on a real master and storage nodes on emulated hosts.

Host hA publishes a directory; fetchers on hB, hC, hD pull its chunks from every host that
holds them and keep a replica on their own node, so they serve later fetchers. A holder killed
mid-transfer costs a retry elsewhere; a chunk altered on one holder fails verification and is
read from another; no wrong byte is ever written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.common.errors import ObjectNotFound, StoreError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.node.server import StorageNode
from mooncake_k8s.store.p2p import get, load_manifest, publish
from mooncake_k8s.store.p2p.api import chunk_key
from mooncake_k8s.store.testing import StoreCluster, start_host_node

MiB = 1 << 20
CHUNK = 256 << 10
HOSTS = {"na": "hA", "nb": "hB", "nc": "hC", "nd": "hD"}


class Bed:
    def __init__(self, cluster: StoreCluster, nodes: dict[str, StorageNode]) -> None:
        self.cluster = cluster
        self.nodes = nodes

    def client(self, host: str) -> StoreClient:
        return self.cluster.client(host_id=host, attempt_timeout_s=0.5, suspect_s=0.0)

    def holders(self, key: str) -> list[str]:
        with self.cluster.client(location_cache=False) as c:
            got = c._lookup([key], use_cache=False)[0]
        return sorted(loc.peer.host_id for loc in got.replicas) if got else []


@pytest.fixture
def bed() -> Iterator[Bed]:
    with StoreCluster() as cluster:
        cluster.start_master()
        nodes: dict[str, StorageNode] = {}
        try:
            for n, h in HOSTS.items():
                nodes[n] = start_host_node(cluster, n, h, 16 * MiB)
            cluster.wait_nodes(len(nodes))
            yield Bed(cluster, nodes)
        finally:
            for node in nodes.values():
                node.stop()


def model_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "weights.bin").write_bytes(os.urandom(5 * CHUNK + 1234))
    (root / "sub" / "config.json").write_bytes(b'{"layers": 2}')
    (root / "empty").write_bytes(b"")
    (root / "run.sh").write_bytes(b"#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    return root


def same_tree(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        assert (a / rel).stat().st_mode == (b / rel).stat().st_mode, rel


def test_publish_then_get_on_two_hosts_which_then_serve_it(bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "org/model", client=a, chunk_size=CHUNK)
    assert len(man.chunks) == 8  # 6 of weights, 1 of config, 1 of run.sh
    assert bed.holders(chunk_key(man, 0)) == ["hA"]
    with bed.client("hB") as b:
        got = get("org/model", tmp_path / "b", client=b)
    same_tree(src, tmp_path / "b")
    assert got.counters.fetched == 8 and got.counters.kept == 8
    assert got.counters.by_host == {"hA": 8}
    assert all(bed.holders(chunk_key(man, i)) == ["hA", "hB"] for i in range(8))
    with bed.client("hC") as c:
        got = get("org/model", tmp_path / "c", client=c, parallel=4)
    same_tree(src, tmp_path / "c")
    # the second fetcher spread its reads over both holders
    assert got.counters.by_host.get("hA", 0) > 0 and got.counters.by_host.get("hB", 0) > 0
    assert bed.holders(chunk_key(man, 3)) == ["hA", "hB", "hC"]
    # a rerun is idempotent: every chunk verified in place, nothing fetched
    with bed.client("hC") as c:
        again = get("org/model", tmp_path / "c", client=c)
    assert again.counters.fetched == 0 and again.counters.reused == 8
    same_tree(src, tmp_path / "c")
    # a file altered in place: the rerun refetches its one bad chunk and replaces it whole
    weights = tmp_path / "c" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[CHUNK + 5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with bed.client("hC") as c:
        again = get("org/model", tmp_path / "c", client=c)
    assert again.counters.fetched == 1 and again.counters.reused == 7
    same_tree(src, tmp_path / "c")


def test_a_source_killed_mid_transfer_costs_a_retry_never_a_byte(
        bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "ckpt", client=a, chunk_size=CHUNK)
    with bed.client("hB") as b:
        get("ckpt", tmp_path / "b", client=b)
    written: list[int] = []

    def kill_source(index: int) -> None:
        written.append(index)
        if len(written) == 2:
            bed.nodes["na"].stop()

    with bed.client("hC") as c:
        got = get("ckpt", tmp_path / "c", client=c, parallel=1, on_chunk=kill_source)
    same_tree(src, tmp_path / "c")
    assert got.counters.failed_reads >= 1  # some chunk was asked of the dead source first
    assert got.counters.by_host.get("hB", 0) >= len(man.chunks) - 2


def test_a_chunk_altered_on_one_holder_is_refetched_elsewhere(
        bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "m", client=a, chunk_size=CHUNK)
    with bed.client("hB") as b:
        get("m", tmp_path / "b", client=b)
    # flip a byte of every chunk in hA's node memory: with two reads at once and one per
    # holder, hC asks hA for some, and every chunk must come verified from hB
    with bed.cluster.client(location_cache=False) as c:
        for i in range(len(man.chunks)):
            info = c._lookup([chunk_key(man, i)], use_cache=False)[0]
            assert info is not None
            loc = next(r for r in info.replicas if r.peer.host_id == "hA")
            bed.nodes["na"].segments[loc.segment.name].buf[loc.offset + info.size // 2] ^= 0xFF
    with bed.client("hC") as c:
        got = get("m", tmp_path / "c", client=c, parallel=2)
    same_tree(src, tmp_path / "c")
    assert got.counters.corrupt >= 1
    assert got.counters.by_host == {"hB": len(man.chunks)}


def test_a_chunk_no_holder_serves_right_fails_and_writes_nothing_wrong(
        bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "solo", client=a, chunk_size=CHUNK)
    weights = next(f for f in man.files if f.path == "weights.bin")
    with bed.cluster.client(location_cache=False) as c:  # the third chunk of weights.bin
        info = c._lookup([chunk_key(man, weights.first + 2)], use_cache=False)[0]
        assert info is not None
        loc = info.replicas[0]
        bed.nodes["na"].segments[loc.segment.name].buf[loc.offset] ^= 0xFF
    dest = tmp_path / "d"
    with bed.client("hD") as d, pytest.raises(StoreError, match="no holder served it"):
        get("solo", dest, client=d, parallel=1, keep=False, shuffle=False)
    assert not (dest / "weights.bin").exists()  # only the part file, never the final name
    part = dest / "weights.bin.p2p-part"
    data = (src / "weights.bin").read_bytes()
    got = part.read_bytes()
    assert got[:2 * CHUNK] == data[:2 * CHUNK] and got[2 * CHUNK:3 * CHUNK] == bytes(CHUNK)
    # repaired at the source: the rerun resumes, fetching only what the part file lacks
    bed.nodes["na"].segments[loc.segment.name].buf[loc.offset] ^= 0xFF
    with bed.client("hD") as d:
        again = get("solo", dest, client=d, keep=False)
    same_tree(src, dest)
    # run.sh and config.json complete, weights.bin's first two chunks (and any fetched after
    # the failure, before the fetch stopped) verified in its part file
    assert again.counters.reused >= 4 and again.counters.fetched == 8 - again.counters.reused


def test_get_of_an_unpublished_name_says_so(bed: Bed, tmp_path: Path) -> None:
    with bed.client("hB") as b, pytest.raises(ObjectNotFound, match="nothing is published"):
        get("nope", tmp_path / "x", client=b)


def mooncake(*args: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "mooncake_k8s.cli", "p2p", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_cli_publishes_and_gets(bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    addr, token = bed.cluster.master_address, bed.cluster.token
    pub = mooncake("publish", str(src), "cli/model", "--master", addr, "--chunk-size", "256KiB",
                   "--no-pin", token=token)
    assert pub.returncode == 0, pub.stderr
    assert json.loads(pub.stdout)["chunks"] == 8
    got = mooncake("get", "cli/model", str(tmp_path / "out"), "--master", addr, token=token)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["fetched"] == 8
    same_tree(src, tmp_path / "out")
    # this process's host has no storage node: it kept its replicas on another node
    with bed.client("hA") as a:
        man = load_manifest(a, "cli/model")
    assert all(len(set(bed.holders(chunk_key(man, i)))) == 2 for i in range(8))
    miss = mooncake("get", "no/such", str(tmp_path / "x"), "--master", addr, token=token)
    assert miss.returncode == 1 and "nothing is published under p2p name 'no/such'" in miss.stderr
    bad = mooncake("get", "../up", str(tmp_path / "x"), "--master", addr, token=token)
    assert bad.returncode == 2 and "p2p name '../up'" in bad.stderr


def test_fetchers_on_three_hosts_at_once_each_get_every_byte_and_serve_it(
        bed: Bed, tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "wave", client=a, chunk_size=CHUNK)
    results: dict[str, Any] = {}

    def fetch(host: str) -> None:
        try:
            with bed.client(host) as c:
                results[host] = get("wave", tmp_path / host, client=c, parallel=3)
        except Exception as e:  # reported below, with the host
            results[host] = e

    threads = [threading.Thread(target=fetch, args=(h,)) for h in ("hB", "hC", "hD")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for host in ("hB", "hC", "hD"):
        assert not isinstance(results[host], Exception), (host, results[host])
        same_tree(src, tmp_path / host)
        assert results[host].counters.corrupt == 0
    for i in range(len(man.chunks)):  # every fetcher now holds every chunk on its host
        assert bed.holders(chunk_key(man, i)) == ["hA", "hB", "hC", "hD"]


def test_republishing_a_name_makes_the_old_chunks_evictable(tmp_path: Path) -> None:
    """One 4 MiB node holding another published object (1 MiB, pinned, least recently used):
    a name's second version (1.5 MiB) makes room by evicting the first version's chunks, which
    became cache again, not the other object's (pins are soft: without the unpinning the LRU
    pinned object, the other one, would go first)."""
    def tree(name: str, size: int) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "w.bin").write_bytes(os.urandom(size))
        return d

    with StoreCluster() as cluster:
        cluster.start_master()
        node = start_host_node(cluster, "solo", "hA", 4 * MiB)
        try:
            with cluster.client(host_id="hA") as a:
                other = publish(tree("other", 4 * CHUNK), "other", client=a, chunk_size=CHUNK)
                first = publish(tree("v1", 6 * CHUNK), "m", client=a, chunk_size=CHUNK)
                publish(tree("v2", 6 * CHUNK), "m", client=a, chunk_size=CHUNK)
                assert all(a.exists([chunk_key(other, i) for i in range(4)]))
                assert not all(a.exists([chunk_key(first, i) for i in range(6)]))
            with cluster.client(host_id="hB") as b:
                get("m", tmp_path / "got", client=b, keep=False)
                get("other", tmp_path / "got-other", client=b, keep=False)
            same_tree(tmp_path / "v2", tmp_path / "got")
            same_tree(tmp_path / "other", tmp_path / "got-other")
        finally:
            node.stop()


def test_a_fetcher_asks_peers_first_and_the_source_for_what_no_peer_has(
        bed: Bed, tmp_path: Path) -> None:
    """Fetchers that start together must not all queue on the source: hC takes the chunks
    hB kept from hB (it holds fewer of those hC needs than the source), asks the source
    only for a chunk no peer holds (rarest first) and never twice at once."""
    from mooncake_k8s.store.p2p.api import keep_segment
    from mooncake_k8s.store.p2p.holders import Counters, Holders, Job

    src = model_dir(tmp_path / "src")
    with bed.client("hA") as a:
        man = publish(src, "busy", client=a, chunk_size=CHUNK)
    jobs = [Job(i, chunk_key(man, i), man.chunks[i]) for i in range(len(man.chunks))]

    def take(h: Holders, pending: list[Job]) -> tuple[Job, str]:
        h.refresh(pending, force=True)
        picked = h.choose(pending)
        assert picked is not None
        job, loc = picked
        pending.remove(job)
        assert h.read(job, loc, memoryview(bytearray(job.chunk.size)))
        return job, loc.peer.host_id

    with bed.client("hB") as b:  # hB is mid-way: it holds chunks 0..3 only
        hb = Holders(b, keep_segment(b, man), Counters())
        for job in jobs[:4]:
            assert take(hb, [job]) == (job, "hA")
    assert bed.holders(chunk_key(man, 1)) == ["hA", "hB"]
    with bed.client("hC") as c:
        hc = Holders(c, "", Counters(), per_holder=1)
        pending = list(reversed(jobs))  # hA-only chunks first in hC's own order
        firsts = [take(hc, pending) for _ in range(4)]
        assert sorted(j.index for j, _ in firsts) == [0, 1, 2, 3]
        assert {h for _, h in firsts} == {"hB"}
        # with its one read from hB in flight, hC asks hA for a chunk only hA holds; with
        # hA busy too, nothing is free: it waits rather than queue a second read on hA
        hc.refresh(pending, force=True)
        picked = hc.choose(pending)
        assert picked is not None and picked[1].peer.host_id == "hA"
        assert picked[0].index >= 4
        assert hc.choose([j for j in pending if j is not picked[0]]) is None
        assert hc.read(picked[0], picked[1], memoryview(bytearray(picked[0].chunk.size)))
    assert hc.counters.by_host == {"hB": 4, "hA": 1}
