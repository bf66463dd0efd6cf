"""A storage node killed with -9 and started again, with real processes: its SSD tier's objects
are verified and served again (one altered on purpose is dropped), a directory of another node
is refused with a message, and /dev/shm holds one DRAM segment per live node, none after."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import pytest

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import ObjectNotFound
from mooncake_k8s.store.node.ssd import Journal, Record, _parse
from mooncake_k8s.store.testing import StoreCluster, metric_value
from mooncake_k8s.transfer import Segment
from mooncake_k8s.transfer.segments import SHM_DIR, cluster_tag

KiB, MiB = 1 << 10, 1 << 20


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def shm_files(cluster: StoreCluster, node_id: str) -> list[str]:
    tag = cluster_tag([cluster.master_address])
    return glob.glob(os.path.join(SHM_DIR, f"mooncake-{tag}-{node_id}-dram-*"))


def offsets(ssd: Path, segment: str) -> dict[str, int]:
    """Where the journal says each key lives (read as the node reads it at start)."""
    out: dict[str, int] = {}
    for raw in (ssd / f"mooncake-{segment}.journal").read_bytes().splitlines(keepends=True):
        rec = _parse(raw)
        assert rec is not None and not isinstance(rec, int)
        out[rec.key] = rec.offset
    return out


def test_ssd_objects_survive_kill_9_and_a_corrupted_one_is_dropped(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    objs = {f"k{i}": payload(64 * KiB + i, i) for i in range(4)}
    with StoreCluster() as cluster:
        cluster.start_master()
        node = cluster.start_node("a", "8MiB", "--ssd-dir", str(ssd), "--ssd-size", "8MiB")
        # Classic puts: a space lease's SpaceRelease thread can outlive the client's close and
        # leave a fast-path socket unclosed (a client race outside this test's subject).
        with cluster.client(space_lease_bytes=0) as c:
            for key, data in objs.items():
                c.put(key, data, segments=["a-ssd-0"])
        cluster.wait_inventory(len(objs))
        where = offsets(ssd, "a-ssd-0")
        assert set(where) == set(objs), "every put is journaled"
        cluster.kill(node)  # kill -9: no goodbye
        assert len(shm_files(cluster, "a")) == 1, "the dead node's DRAM file is left behind"
        with open(ssd / "mooncake-a-ssd-0.seg", "r+b") as f:  # alter one object's bytes
            f.seek(where["k2"] + 100)
            f.write(b"\xff\x00\xff\x00")
        node = cluster.restart_node("a")
        text = node.metrics()
        assert metric_value(text, "mooncake_node_ssd_adopted_objects_total",
                            'result="verified"') == 3
        assert metric_value(text, "mooncake_node_ssd_adopted_objects_total",
                            'result="dropped"') == 1
        with cluster.client(space_lease_bytes=0) as c:
            assert c.exists(list(objs)) == [True, True, False, True]
            for key in ("k0", "k1", "k3"):
                assert bytes(c.get(key)) == objs[key]
            with pytest.raises(ObjectNotFound):
                c.get("k2")
            c.put("k2", objs["k2"], segments=["a-ssd-0"])
            assert bytes(c.get("k2")) == objs["k2"]
        files = shm_files(cluster, "a")
        assert len(files) == 1 and os.path.getsize(files[0]) == 8 * MiB, files
        assert "Traceback" not in node.log()
    assert shm_files(cluster, "a") == [], "the harness leaves no segment behind"


def test_directory_of_another_node_is_refused(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    with StoreCluster() as cluster:
        cluster.start_master()
        a = cluster.start_node("a", "4MiB", "--ssd-dir", str(ssd), "--ssd-size", "4MiB")
        cluster.kill(a)
        b = cluster.start_node("b", "4MiB", "--ssd-dir", str(ssd), "--ssd-size", "4MiB",
                               wait=False)
        assert b.popen.wait(timeout=60) != 0
        log = b.log()
        assert "belongs to node 'a', not 'b'" in log and "Traceback" not in log, log
        assert shm_files(cluster, "b") == [], "a refused node leaves no DRAM segment"
        c = cluster.start_node("a", "4MiB", "--ssd-dir", str(ssd), "--ssd-size", "8MiB",
                               wait=False)
        assert c.popen.wait(timeout=60) != 0
        assert "keep the same --ssd-size" in c.log() and "Traceback" not in c.log()


def test_journal_drops_a_torn_line(tmp_path: Path) -> None:
    seg, adopted = Segment.adopt_file("t-ssd-0", str(tmp_path), 64 * KiB)
    assert not adopted
    data = payload(1000, 7)
    seg.buf[0:1000] = data
    j = Journal(str(tmp_path), "t-ssd-0")
    assert j.recover(seg) == ([], 0)
    j.committed(Record("x", 0, 1000, checksum(data)))
    j.close()
    with open(j.path, "ab") as f:
        f.write(b"C 2000 10 12")  # torn: the process died mid-line
    seg.close()
    assert (tmp_path / "mooncake-t-ssd-0.seg").exists(), "an SSD file outlives its process"
    seg, adopted = Segment.adopt_file("t-ssd-0", str(tmp_path), 64 * KiB)
    kept, dropped = Journal(str(tmp_path), "t-ssd-0").recover(seg)
    assert adopted and dropped == 1 and [r.key for r in kept] == ["x"]
    seg.close()


def test_journal_compacts_what_was_freed(tmp_path: Path) -> None:
    seg, _ = Segment.adopt_file("c-ssd-0", str(tmp_path), 64 * KiB)
    data = payload(100, 3)
    seg.buf[0:100] = data
    j = Journal(str(tmp_path), "c-ssd-0")
    j.recover(seg)
    keep = Record("keep", 0, 100, checksum(data))
    j.committed(keep)
    for i in range(5000):  # objects come and go
        j.committed(Record(f"gone{i}", 4096, 10, 1))
        j.freed(4096)
    assert j.should_compact(1)
    j.rewrite([keep])
    assert j.lines == 1 and not j.should_compact(1)
    j.close()
    kept, dropped = Journal(str(tmp_path), "c-ssd-0").recover(seg)
    assert kept == [keep] and dropped == 0
    seg.close()
