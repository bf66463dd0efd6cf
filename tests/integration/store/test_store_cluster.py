"""The store end to end: a real master and real nodes as processes, the real client."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_k8s.common.errors import (
    AuthError,
    BufferTooSmall,
    InvalidArgument,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
)
from mooncake_k8s.common.netutil import split_address
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import StoreCluster, metric_value

KiB, MiB = 1 << 10, 1 << 20


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("a", "96MiB")
        yield c


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [64 * KiB, 1 * MiB, 16 * MiB])
def test_round_trip_all_sizes(cluster: StoreCluster, transport: str, size: int) -> None:
    with cluster.client(transport=transport) as c:
        key = f"rt-{transport}-{size}"
        data = payload(size, size)
        c.put(key, data)
        assert bytes(c.get(key)) == data.tobytes()
        out = np.empty(size, dtype=np.uint8)
        assert c.get_into(key, out) == size
        assert np.array_equal(out, data)
        bigger = bytearray(size + 100)
        assert c.get_into(key, memoryview(bigger)) == size
        assert bigger[:size] == data.tobytes()
        assert c.engine.transport_name(c._lookup([key])[0].replicas[0].peer) == transport  # type: ignore[union-attr]
        assert c.remove(key) == [True]
        with pytest.raises(ObjectNotFound):
            c.get(key)


def test_batched_ops_and_prefix(cluster: StoreCluster) -> None:
    keys = [f"batch-{i}" for i in range(40)]
    datas = [payload(8 * KiB + i, i) for i in range(40)]
    with cluster.client() as c:
        assert c.batch_put(keys, datas) == [None] * 40
        errs = c.batch_put(keys[:2], datas[:2])
        assert all(isinstance(e, ObjectExists) for e in errs)
        bufs = [np.empty(len(d), dtype=np.uint8) for d in datas]
        assert c.batch_get_into(keys, bufs) == [len(d) for d in datas]
        assert all(np.array_equal(b, d) for b, d in zip(bufs, datas, strict=True))
        probe = [*keys[:5], "nope", keys[6]]
        assert c.exists(probe) == [True] * 5 + [False, True]
        assert c.prefix_len(probe) == 5
        res = c.batch_get_into(["nope", keys[0]], [bytearray(10), bytearray(len(datas[0]))])
        assert res == [None, len(datas[0])]
        assert c.remove(keys) == [True] * 40
        assert not any(c.exists(keys))


def test_concurrent_clients_threads_and_processes(cluster: StoreCluster) -> None:
    script = (
        "import sys, numpy as np\n"
        "from mooncake_k8s.store.client import StoreClient\n"
        "c = StoreClient(sys.argv[1], sys.argv[2])\n"
        "for i in range(30):\n"
        "    k = f'proc-{sys.argv[3]}-{i}'\n"
        "    d = np.full(50_000 + i, i % 251, dtype=np.uint8)\n"
        "    c.put(k, d)\n"
        "    assert bytes(c.get(k)) == d.tobytes()\n"
        "print('ok')\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, cluster.master_address, cluster.token, str(p)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for p in range(2)
    ]

    def worker(t: int) -> int:
        with cluster.client() as c:
            for i in range(30):
                k = f"thr-{t}-{i}"
                d = payload(20_000 + i, t * 100 + i)
                c.put(k, d)
                assert bytes(c.get(k)) == d.tobytes()
        return t

    with cf.ThreadPoolExecutor(4) as ex:
        assert sorted(ex.map(worker, range(4))) == [0, 1, 2, 3]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out.decode()


def test_bad_inputs_get_specific_errors(cluster: StoreCluster) -> None:
    with cluster.client() as c:
        with pytest.raises(ObjectTooLarge):
            c.put("huge", np.zeros(200 * MiB, dtype=np.uint8))
        with pytest.raises(InvalidArgument):
            c.put("", b"x")
        with pytest.raises(InvalidArgument):
            c.put("empty", b"")
        with pytest.raises(ObjectNotFound):
            c.get("never-stored")
        c.put("small", b"0123456789")
        with pytest.raises(BufferTooSmall):
            c.get_into("small", bytearray(5))
        with pytest.raises(InvalidArgument):
            c.get_into("small", b"read-only buffer")
    with StoreClient(cluster.master_address, "wrong-token") as bad, pytest.raises(AuthError):
        bad.exists(["small"])
    # Garbage on the node's transfer port: the connection dies, the node keeps serving.
    replica = cluster.client()._lookup(["small"])[0].replicas[0]  # type: ignore[union-attr]
    host, port = split_address(replica.peer.address)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096), b"MCTE"):
        with socket.create_connection((host, port), timeout=5) as s:
            try:  # the server may close (even reset) the connection at any point here
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                while s.recv(4096):
                    pass
            except OSError:
                pass
    with cluster.client(transport="tcp") as c:
        assert bytes(c.get("small")) == b"0123456789"
    assert cluster.master is not None and cluster.master.alive()
    assert all(n.alive() for n in cluster.nodes.values())


def test_metrics_exposed(cluster: StoreCluster) -> None:
    with cluster.client(transport="tcp", location_cache=False) as c:
        c.put("metric-obj", payload(100 * KiB, 3))
        c.get("metric-obj")
        with pytest.raises(ObjectNotFound):
            c.get("metric-missing")
    assert cluster.master is not None
    m = cluster.master.metrics()
    assert metric_value(m, "mooncake_store_lookups_total", 'result="hit"') >= 1
    assert metric_value(m, "mooncake_store_lookups_total", 'result="miss"') >= 1
    assert metric_value(m, "mooncake_store_capacity_bytes") == 96 * MiB
    assert "mooncake_master_rpc_seconds_bucket" in m
    n = cluster.nodes["a"].metrics()
    assert metric_value(n, "mooncake_node_transfer_bytes_total", 'direction="out"') >= 100 * KiB
    assert metric_value(n, "mooncake_node_capacity_bytes") == 96 * MiB


def test_events_stream(cluster: StoreCluster) -> None:
    seen: list[tuple[int, str]] = []
    ready = threading.Event()

    with cluster.client() as c:
        stream = c.watch()

        def consume() -> None:
            ready.set()
            for ev in stream:
                seen.append((ev.kind, ev.key))
                if ev.key == "ev-obj" and ev.kind == 3:  # REMOVED
                    return

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        ready.wait(5)
        time.sleep(0.3)
        c.put("ev-obj", b"hello events")
        c.remove("ev-obj")
        t.join(10)
        stream.close()  # type: ignore[attr-defined]
    assert (1, "ev-obj") in seen and (3, "ev-obj") in seen


def test_cli_help() -> None:
    for sub in ("master", "node"):
        r = subprocess.run(
            [sys.executable, "-m", "mooncake_k8s.cli", "store", sub, "--help"],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == 0 and "MOONCAKE_CLUSTER_TOKEN" in r.stdout


def test_refuses_wildcard_bind() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mooncake_k8s.cli", "store", "master", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0 and "refusing to bind every interface" in r.stderr


def test_fill_to_three_times_capacity() -> None:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("fill", "32MiB")
        with c.client() as cl:
            size = 512 * KiB
            n = 3 * 32 * MiB // size
            for i in range(n):
                cl.put(f"fill-{i}", payload(size, i))
            st = cl.stats()
            used = sum(s.used for s in st.segments)
            cap = sum(s.size for s in st.segments)
            assert used <= 0.95 * cap + size
            assert st.evictions > 0
            assert st.objects <= cap // size
            # The newest objects survive and read back intact.
            assert bytes(cl.get(f"fill-{n - 1}")) == payload(size, n - 1).tobytes()
            assert not all(cl.exists([f"fill-{i}" for i in range(10)]))


def test_lease_blocks_eviction_and_removal() -> None:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("lease", "16MiB")
        with c.client() as cl:
            data = payload(1 * MiB, 42)
            cl.put("leased", data)
            lease_id, found = cl.lease(["leased"], 30_000)
            assert found == [True] and lease_id
            for i in range(48):  # 3x capacity of other objects
                cl.put(f"filler-{i}", payload(1 * MiB, i))
            assert cl.exists(["leased"]) == [True], "a leased object was evicted"
            assert bytes(cl.get("leased")) == data.tobytes()
            used_before = sum(s.used for s in cl.stats().segments)
            assert cl.remove("leased") == [True]
            assert cl.exists(["leased"]) == [False], "removal hides the object at once"
            assert sum(s.used for s in cl.stats().segments) == used_before, "space freed early"
            cl.release_lease(lease_id)
            deadline = time.monotonic() + 5
            while sum(s.used for s in cl.stats().segments) != used_before - MiB:
                assert time.monotonic() < deadline, "space not freed after the lease ended"
                time.sleep(0.05)


def test_writer_killed_between_put_start_and_end() -> None:
    with StoreCluster(master_args=["--put-timeout-s", "1"]) as c:
        c.start_master()
        c.start_node("w", "16MiB")
        script = (
            "import sys, os, signal\n"
            "from mooncake_k8s.common.rpc import store_pb2 as pb, store_pb2_grpc as g\n"
            "from mooncake_k8s.common.auth import call_metadata\n"
            "import grpc\n"
            "stub = g.MasterStub(grpc.insecure_channel(sys.argv[1]))\n"
            "r = stub.PutStart(pb.PutStartRequest(key='orphan', size=4<<20, replicas=1),"
            " metadata=call_metadata(sys.argv[2]))\n"
            "print(r.put_id, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", script, c.master_address, c.token],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == -signal.SIGKILL and int(r.stdout.split()[0]) > 0
        with c.client() as cl:
            assert cl.exists(["orphan"]) == [False]
            with pytest.raises(ObjectNotFound):
                cl.get("orphan")
            deadline = time.monotonic() + 10
            while sum(s.used for s in cl.stats().segments) != 0:
                assert time.monotonic() < deadline, "orphaned put space never reclaimed"
                time.sleep(0.1)
            cl.put("orphan", b"finally")
            assert bytes(cl.get("orphan")) == b"finally"


def test_restart_master_rebuilds_from_nodes() -> None:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("r0", "32MiB")
        c.start_node("r1", "32MiB")
        keys = [f"persist-{i}" for i in range(20)]
        datas = [payload(64 * KiB, i) for i in range(20)]
        with c.client() as cl:
            assert cl.batch_put(keys, datas, placement="most_free") == [None] * 20
        time.sleep(0.5)  # nodes learn their inventory from the master's command stream
        assert c.master is not None
        c.kill(c.master)
        t0 = time.monotonic()
        c.start_master()
        with c.client(location_cache=False) as cl:
            while not all(cl.exists(keys)):
                assert time.monotonic() - t0 < 5, "objects not found again within 5 s"
                time.sleep(0.05)
            for k, d in zip(keys, datas, strict=True):
                assert bytes(cl.get(k)) == d.tobytes()


def test_kill_node_during_concurrent_gets() -> None:
    with StoreCluster(master_args=["--node-timeout-s", "1.5"]) as c:
        c.start_master()
        c.start_node("k0", "64MiB")
        c.start_node("k1", "64MiB")
        keys = [f"kn-{i}" for i in range(40)]
        datas = {k: payload(256 * KiB, i).tobytes() for i, k in enumerate(keys)}
        with c.client() as cl:
            assert cl.batch_put(keys, list(datas.values()), placement="most_free") == [None] * 40
            on_k0 = [
                k for k in keys
                if cl._lookup([k])[0].replicas[0].peer.node_id == "k0"  # type: ignore[union-attr]
            ]
        assert on_k0, "placement should have used both nodes"
        results: list[str] = []
        lock = threading.Lock()

        def get(i: int) -> None:
            k = keys[i % len(keys)]
            with c.client(transport="tcp", location_cache=False) as cl:
                for _ in range(5):
                    try:
                        got = bytes(cl.get(k))
                        outcome = "ok" if got == datas[k] else "WRONG"
                    except ObjectNotFound:
                        outcome = "miss"
                    except Exception as e:
                        outcome = f"error:{type(e).__name__}"
                    with lock:
                        results.append(outcome)

        threads = [threading.Thread(target=get, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        c.kill(c.nodes["k0"])
        for t in threads:
            t.join(120)
        assert "WRONG" not in results
        assert set(results) <= {"ok", "miss"}, sorted(set(results))
        with c.client(location_cache=False) as cl:
            deadline = time.monotonic() + 10
            while any(cl.exists(on_k0)):
                assert time.monotonic() < deadline, "dead node's objects still listed"
                time.sleep(0.1)
            survivors = [k for k in keys if k not in on_k0]
            assert all(cl.exists(survivors))


def test_ssd_tier_spill_and_promote(tmp_path: object) -> None:
    with StoreCluster() as c:
        c.start_master()
        c.start_node("ssd", "8MiB", "--ssd-dir", str(tmp_path), "--ssd-size", "64MiB")
        with c.client() as cl:
            datas = {f"sp-{i}": payload(1 * MiB, i).tobytes() for i in range(24)}
            for k, d in datas.items():
                cl.put(k, d)
            deadline = time.monotonic() + 10
            while cl.stats().spills == 0:
                assert time.monotonic() < deadline, "no DRAM victim was spilled to SSD"
                time.sleep(0.1)
            time.sleep(0.5)
            st = cl.stats()
            assert st.objects == 24, "spilled objects must stay in the store"
        with c.client(location_cache=False) as cl:
            # Make room in DRAM (how full the burst left it depends on when spills finished;
            # our own lookups lease what they find, so removal is forced), so that reading an
            # object found only on SSD must promote it. Spills that finish late can fill DRAM
            # again: make room and read again until a promotion shows.
            deadline = time.monotonic() + 30
            removed: set[str] = set()
            while cl.stats().promotions == 0:
                assert time.monotonic() < deadline, "an SSD hit was never promoted"
                infos = cl._lookup([k for k in datas if k not in removed])
                in_dram = [k for k, i in zip([k for k in datas if k not in removed], infos,
                                             strict=True)
                           if i is not None
                           and any(r.segment.tier.value == "dram" for r in i.replicas)]
                assert len(removed) + len(in_dram) < len(datas)
                cl.remove(in_dram, force=True)
                removed.update(in_dram)
                for k, d in datas.items():
                    if k not in removed:
                        assert bytes(cl.get(k)) == d, k
                time.sleep(0.2)


def test_node_sigterm_unlinks_segments() -> None:
    with StoreCluster() as c:
        c.start_master()
        proc = c.start_node("clean", "8MiB")
        with c.client() as cl:
            cl.put("x", b"y")
            path = cl._lookup(["x"])[0].replicas[0].segment.path  # type: ignore[union-attr]
        assert os.path.exists(path)
        c.kill(proc, signal.SIGTERM)
        assert proc.popen.returncode == 0, proc.log()[-2000:]
        assert not os.path.exists(path)


def test_store_replicas_env_is_every_writers_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOONCAKE_STORE_REPLICAS (the operator's store.replicationFactor) sets how many copies a
    put makes when it does not say; a bad value is refused naming the variable."""
    with StoreCluster() as c:
        c.start_master()
        c.start_node("a", "16MiB")
        c.start_node("b", "16MiB")
        monkeypatch.setenv("MOONCAKE_STORE_REPLICAS", "2")
        with c.client() as client:
            assert client.replicas == 2
            client.put("two", b"x" * 4096)
            client.put("one", b"y" * 4096, replicas=1)
            info = client._lookup(["two", "one"], use_cache=False)
            assert [len(i.replicas) for i in info if i is not None] == [2, 1]
        monkeypatch.setenv("MOONCAKE_STORE_REPLICAS", "lots")
        with pytest.raises(InvalidArgument, match="MOONCAKE_STORE_REPLICAS"):
            c.client()
