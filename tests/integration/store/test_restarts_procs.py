"""Restarts and crashes with real processes: a storage node restarted under the same id, a
master killed and restarted, a writer killed between PutStart and PutEnd."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.errors import ObjectExists, ObjectNotFound
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2_grpc as pb_grpc
from mooncake_k8s.store.testing import StoreCluster

KiB = 1 << 10


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def lookup(cluster: StoreCluster, keys: list[str]) -> pb.GetReplicasResponse | grpc.RpcError:
    """One raw GetReplicas: the answer, or the error (to see exactly what the master said)."""
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]
        try:
            resp: pb.GetReplicasResponse = stub.GetReplicas(
                pb.GetReplicasRequest(keys=keys), metadata=call_metadata(cluster.token),
                timeout=5,
            )
            return resp
        except grpc.RpcError as e:
            return e


def is_recovering(answer: object) -> bool:
    if not isinstance(answer, grpc.RpcError):
        return False
    pairs: Any = answer.trailing_metadata() or ()  # type: ignore[attr-defined]
    trailers = dict(pairs)
    return bool(answer.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                and trailers.get("mooncake-recovering") == "1")


def wait_roster(cluster: StoreCluster, nodes: set[str], timeout: float = 30) -> None:
    path = cluster.workdir / "master-state" / "nodes.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and set(json.loads(path.read_text())["nodes"]) == nodes:
            return
        time.sleep(0.05)
    raise TimeoutError(f"roster never listed {nodes}")


def test_restarted_node_leaves_no_phantom_objects() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "16MiB")
        cluster.start_node("b", "16MiB")
        solo, dup = payload(100 * KiB, 1), payload(100 * KiB, 2)
        with cluster.client() as c:
            c.put("solo", solo, placement="preferred", preferred_segment="a-dram-0")
            c.put("dup", dup, replicas=2)
            assert bytes(c.get("dup")) == dup  # cached locations include node a
            cluster.restart_node("a")  # same id, new process, empty segment
            # The moment the new process registered, the master knows what it lost.
            assert c.exists(["solo", "dup"]) == [False, True]
            with pytest.raises(ObjectNotFound):
                c.get("solo")
            assert bytes(c.get("dup")) == dup  # from b; a's stale location fails its checksum
            c.put("solo", solo)  # not ObjectExists: the key is free at once
            assert bytes(c.get("solo")) == solo
            segs = {s.name: s.objects for s in c.stats().segments}
        assert segs["b-dram-0"] == 1 and segs["a-dram-0"] + segs["b-dram-0"] == 2
        assert "node restarted: replicas it no longer holds dropped" in cluster.master.log()  # type: ignore[union-attr]


def test_restarted_master_is_unavailable_until_its_nodes_return() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        a = cluster.start_node("a", "16MiB")
        b = cluster.start_node("b", "16MiB")
        keys = [f"k{i}" for i in range(20)]
        datas = [payload(20 * KiB, i) for i in range(20)]
        with cluster.client() as c:
            for k, d in zip(keys, datas, strict=True):
                c.put(k, d, placement="most_free")
            holders = {r.node_id for o in lookup(cluster, keys).objects  # type: ignore[union-attr]
                       for r in o.replicas}
            assert holders == {"a", "b"}
        wait_roster(cluster, {"a", "b"})
        cluster.wait_inventory(20)
        cluster.pause(b)  # b cannot re-register until resumed
        got: dict[str, bytes] = {}
        with cluster.client(timeout_s=30) as reading:
            try:
                cluster.restart_master("--recovery-grace-s", "120")
                cluster.wait_registered(a)
                deadline = time.monotonic() + 1.0
                answers = []
                while time.monotonic() < deadline:
                    answers.append(lookup(cluster, keys))
                    time.sleep(0.05)
                # Never a miss for a stored key: only "unavailable, retry".
                assert answers and all(is_recovering(x) for x in answers), answers[-1]
                assert reading.stats().recovering
                reader = threading.Thread(
                    target=lambda: got.update(k=bytes(reading.get(keys[0]))), daemon=True
                )
                def put_new() -> None:  # a put refused while rebuilding is retried too
                    reading.put("new", b"w")
                    got["w"] = b"ok"

                writer = threading.Thread(target=put_new, daemon=True)
                reader.start()  # retries inside the client while the master rebuilds
                writer.start()
                time.sleep(0.3)
                assert reader.is_alive() and writer.is_alive()
            finally:
                cluster.resume(b)
            reader.join(timeout=60)
            writer.join(timeout=60)
            assert bytes(reading.get("new")) == b"w"
        assert got["k"] == datas[0] and got["w"] == b"ok"
        final = lookup(cluster, keys)
        assert not isinstance(final, grpc.RpcError)
        assert [o.found for o in final.objects] == [True] * 20
        with cluster.client() as c:
            assert not c.stats().recovering
            assert all(bytes(c.get(k)) == d for k, d in zip(keys, datas, strict=True))


def test_master_without_state_dir_waits_for_its_grace_period() -> None:
    with StoreCluster(master_state=False) as cluster:
        cluster.start_master("--recovery-grace-s", "0")  # a first start may skip the wait
        cluster.start_node("a", "16MiB")
        with cluster.client() as c:
            c.put("k", b"still here")
        cluster.wait_inventory(1)  # the node knows the commit: what a new master rebuilds from
        cluster.restart_master("--recovery-grace-s", "3")
        start = time.monotonic()
        first = lookup(cluster, ["k"])
        assert is_recovering(first)  # it cannot know whom to wait for: grace period
        with cluster.client(timeout_s=30) as c:
            assert bytes(c.get("k")) == b"still here"
        print(f"\nmaster without a roster answered after {time.monotonic() - start:.2f}s")


WRITER = """
import sys, time
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client import StoreClient
c = StoreClient(sys.argv[1], sys.argv[2])
r = c._call("PutStart", pb.PutStartRequest(key="crash-k", size=1000))
assert r.put_id and not r.exists
print("started", flush=True)
time.sleep(600)
"""


def test_crashed_writer_does_not_block_its_key(tmp_path: Path) -> None:
    with StoreCluster() as cluster:
        cluster.start_master("--put-timeout-s", "300", "--put-claim-s", "1")
        cluster.start_node("a", "16MiB")
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, cluster.master_address, cluster.token],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "started"
            with cluster.client() as c:
                assert c.exists(["crash-k"]) == [False]  # pending is never "present"
                writer.kill()
                writer.wait(timeout=10)
                killed = time.monotonic()
                data = payload(1000, 7)
                refused = 0
                deadline = killed + 60  # far below the 300 s put timeout
                while True:
                    try:
                        c.put("crash-k", data)
                        break
                    except ObjectExists as e:
                        assert "being written by another client" in str(e)
                        refused += 1
                        assert time.monotonic() < deadline, "the dead writer's key stayed blocked"
                        time.sleep(0.05)
                took = time.monotonic() - killed
                assert bytes(c.get("crash-k")) == data
                assert c.stats().pending_puts == 1  # the dead put's space waits for its timeout
        finally:
            writer.kill()
            writer.communicate(timeout=10)
        print(f"\nkey free {took:.2f}s after its writer was killed ({refused} refusals)")
