"""A worker's DRAM segment (the store's embedding API, as a decode worker serves it) killed with
-9 and started again, with real processes: /dev/shm holds one segment of the expected size,
never a second one beside the dead one's; a live owner's segment is never taken; the harness
leaves nothing behind."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from mooncake_k8s.store.testing import StoreCluster
from mooncake_k8s.transfer.segments import SHM_DIR, cluster_tag

SIZE = 4 << 20
OWNER = "decode-decode-0"
SCRIPT = """
import sys, time
from mooncake_k8s.store.local import LocalSegment, LocalSegmentConfig
seg = LocalSegment(LocalSegmentConfig(master=sys.argv[1], owner_id=sys.argv[2],
                                      size=int(sys.argv[3]), token=sys.argv[4]))
seg.start()
while not seg.registered():
    time.sleep(0.05)
print("registered", flush=True)
time.sleep(600)
"""


def start_owner(cluster: StoreCluster) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, cluster.master_address, OWNER, str(SIZE), cluster.token],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def stop(proc: subprocess.Popen[str]) -> str:
    """Kill -9 (no goodbye) and return what it printed."""
    proc.kill()
    proc.wait(timeout=30)
    assert proc.stdout is not None
    with proc.stdout:
        return proc.stdout.read()


def wait_registered(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the owner prints once registered (after any logs), or dies
        if line.strip() == "registered":
            return
        seen.append(line)
    raise AssertionError("".join(seen))


def files(cluster: StoreCluster) -> list[str]:
    tag = cluster_tag([cluster.master_address])
    return glob.glob(os.path.join(SHM_DIR, f"mooncake-{tag}-{OWNER}-dram-*"))


def test_restarted_owner_reclaims_its_dead_predecessors_segment() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        first = start_owner(cluster)
        try:
            wait_registered(first)
            assert [os.path.getsize(f) for f in files(cluster)] == [SIZE]
            # A second owner of the same id while the first lives is refused, and takes nothing.
            twin = start_owner(cluster)
            assert twin.wait(timeout=60) != 0
            assert "held by a live process" in stop(twin)
            assert [os.path.getsize(f) for f in files(cluster)] == [SIZE]
            stop(first)  # the file stays behind
            left = files(cluster)
            assert len(left) == 1
            ino = os.stat(left[0]).st_ino
            second = start_owner(cluster)
            try:
                wait_registered(second)
                now = files(cluster)
                assert [os.path.getsize(f) for f in now] == [SIZE], now
                assert os.stat(now[0]).st_ino != ino, "a fresh segment, not the dead one's bytes"
                with cluster.client() as c:
                    segs = {s.name: s.size for s in c.stats().segments}
                assert segs.get(f"{OWNER}-dram-0") == SIZE
            finally:
                stop(second)
        finally:
            if first.stdout is not None and not first.stdout.closed:
                stop(first)
        assert len(files(cluster)) == 1, "killed: its file is still there until the harness stops"
    assert files(cluster) == [], "the harness removes what killed owners left"
