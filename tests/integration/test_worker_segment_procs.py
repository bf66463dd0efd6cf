"""Both worker roles serve pool memory on their own host (issue 20 item 2): a real master on
loopback, real workers with the built-in model.

A prefill worker started as `mooncake prefill --local-segment-size ...` registers its segment
with the master, serves it (a put placed there reads back), turns ready only then, and reports
the segment and its host id in its Load report; the Conductor matches that host id against
the segments' hosts to know what is local. A decode worker (here in the test's process, the
real service class) does the same, and asks its engine to keep blocks it read from another
host in its own segment exactly when the plan says `keep_fetched`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.netutil import free_port, local_host_id
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.decode.service import DecodeService
from mooncake_k8s.engine import EngineConfig
from mooncake_k8s.store.testing import StoreCluster
from mooncake_k8s.worker.base import WorkerConfig

pytestmark = pytest.mark.timeout(300)
SEGMENT = 8 << 20


@pytest.fixture
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster(token="segment-test-token") as c:
        c.start_master()
        yield c


def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def _load(port: int, role: str, token: str) -> pb.LoadReport:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        rep: pb.LoadReport = serving_rpc.stub(role, ch).Load(
            pb.LoadRequest(), metadata=call_metadata(token), timeout=10)
        return rep


def _served(cluster: StoreCluster, segment: str) -> None:
    """The master lists the segment at its size, and a put placed on it reads back."""
    with cluster.client() as c:
        sizes = {s.name: s.size for s in c.stats().segments}
        assert sizes.get(segment) == SEGMENT, sizes
        payload = os.urandom(64 << 10)
        c.put(f"on-{segment}", payload, placement="preferred", preferred_segment=segment)
        assert bytes(c.get(f"on-{segment}")) == payload


def test_a_prefill_worker_serves_and_reports_its_segment(cluster: StoreCluster,
                                                         tmp_path: Path) -> None:
    port, metrics = free_port(), free_port()
    log = open(tmp_path / "prefill.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_k8s.cli", "prefill", "--master",
         cluster.master_address, "--port", str(port), "--metrics-port", str(metrics),
         "--instance-id", "prefill-0", "--threads", "1", "--log-format", "text",
         "--local-segment-size", "8MiB"],
        env={**os.environ, "MOONCAKE_CLUSTER_TOKEN": cluster.token},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _readyz(metrics)[0] != 200:
            assert proc.poll() is None, (tmp_path / "prefill.log").read_text()[-3000:]
            assert time.monotonic() < deadline, _readyz(metrics)
            time.sleep(0.2)
        rep = _load(port, "prefill", cluster.token)
        # Named by role and instance (stable across restarts; the file is tagged by cluster).
        assert rep.local_segment == "prefill-prefill-0-dram-0"
        assert rep.ready and rep.role == "prefill"
        assert rep.host_id == local_host_id()  # this test shares the worker's host and IPC
        _served(cluster, rep.local_segment)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_a_decode_worker_serves_its_segment_and_keeps_fetched_blocks_there(
        cluster: StoreCluster) -> None:
    svc = DecodeService(WorkerConfig(
        role="decode", master=cluster.master_address, engine=EngineConfig(threads=1),
        token=cluster.token, metrics_port=None, instance_id="decode-0",
        local_segment_size=SEGMENT))
    svc.start()
    try:
        deadline = time.monotonic() + 240
        while svc.not_ready() is not None:
            assert svc.engine_error is None, svc.engine_error
            assert time.monotonic() < deadline, svc.not_ready()
            time.sleep(0.2)
        rep = _load(svc.port, "decode", cluster.token)
        assert rep.local_segment == "decode-decode-0-dram-0" == svc.local_segment
        assert rep.host_id == local_host_id() and rep.ready
        _served(cluster, rep.local_segment)
        info = svc.loaded().info
        tokens = list(range(1, 2 * info.block_tokens + 5))
        plan = pb.KVPlan(block_keys=info.block_keys(tokens), planned=True,
                         namespace=info.namespace("").digest().hex())
        for keep, where in ((True, rep.local_segment), (False, "")):
            plan.keep_fetched = keep
            work = svc._work(pb.DecodeRequest(request_id="r", token_ids=tokens, first_token=7,
                                              plan=plan))
            assert work.keep_on == where and work.keys == list(plan.block_keys)
        # What the store client kept (nothing yet: every block here is on this host).
        text = generate_latest(svc.registry).decode()
        for outcome in ("kept", "skipped", "failed"):
            assert f'mooncake_worker_keep_blocks_total{{outcome="{outcome}"}} 0.0' in text
    finally:
        svc.drain_and_stop()
