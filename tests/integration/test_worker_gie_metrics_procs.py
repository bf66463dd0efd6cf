"""Gateway API Inference Extension metric names on real workers: `mooncake prefill` and
`mooncake decode` processes with the built-in model, scraped over HTTP as a picker would.

Each worker's /metrics carries vllm:num_requests_waiting, vllm:num_requests_running and
vllm:kv_cache_usage_perc, labelled with the served model, and their values are the ones its
own LoadReport (the Conductor's Load poll) gives. How a report maps to the three gauges is
checked on its own with reports that have load in them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.worker import gie_metrics
from mooncake_k8s.worker.gie_metrics import KV_USAGE, NAMES, QUEUED, RUNNING

TOKEN = "gie-test-token"
pytestmark = pytest.mark.timeout(300)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def _start(role: str) -> tuple[subprocess.Popen[bytes], int, int]:
    port, metrics = free_port(), free_port()
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN}
    # No master: the gauges come from the engine and the worker, not the store.
    args = [sys.executable, "-m", "mooncake_k8s.cli", role, "--master", "127.0.0.1:1",
            "--port", str(port), "--metrics-port", str(metrics), "--threads", "1",
            "--log-format", "text", "--local-segment-size", "0"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port, metrics


def _ready(proc: subprocess.Popen[bytes], metrics: int) -> None:
    """Wait for readiness (the model loaded), not for a duration; fail if the worker died."""
    end = time.monotonic() + 180
    while time.monotonic() < end:
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        if _get(metrics, "/readyz")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the worker never turned ready")


def _load(role: str, port: int) -> pb.LoadReport:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        report: pb.LoadReport = serving_rpc.stub(role, ch).Load(
            pb.LoadRequest(), metadata=call_metadata(TOKEN), timeout=30)
        return report


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, tuple[int, int]]]:
    """Both roles, started together so their models load side by side."""
    procs = {role: _start(role) for role in ("prefill", "decode")}
    try:
        for proc, _, metrics in procs.values():
            _ready(proc, metrics)
        yield {role: (port, metrics) for role, (_, port, metrics) in procs.items()}
    finally:
        for proc, _, _ in procs.values():
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_real_worker_exports_the_gie_names(role: str,
                                             workers: dict[str, tuple[int, int]]) -> None:
    port, metrics = workers[role]
    code, text = _get(metrics, "/metrics")
    assert code == 200
    found = {f.name: f for f in text_string_to_metric_families(text) if f.name in NAMES}
    assert set(found) == set(NAMES)
    report = _load(role, port)
    assert report.model  # the served model: what the gauges are labelled with
    expected = dict(zip((QUEUED, RUNNING, KV_USAGE), gie_metrics.gauges(report), strict=True))
    for name, fam in found.items():
        assert fam.type == "gauge"
        (sample,) = fam.samples
        assert sample.labels == {"model_name": report.model}
        assert sample.value == pytest.approx(expected[name]), name
        assert sample.value >= 0
    assert 0.0 <= found[KV_USAGE].samples[0].value <= 1.0
    if role == "decode":
        assert report.kv_capacity_tokens > 0  # decode's KV use is the engine's cache


def test_gauges_from_reports_with_load() -> None:
    decode = pb.LoadReport(role="decode", running=7, waiting=3, kv_free_tokens=250,
                           kv_capacity_tokens=1000)
    queued, running, used = gie_metrics.gauges(decode)
    assert (queued, running) == (3, 4) and used == pytest.approx(0.75)
    # A prefill computes one of its pending prompts; the others wait. It keeps no KV.
    assert gie_metrics.gauges(pb.LoadReport(role="prefill", queued_requests=5)) == (4, 1, 0.0)
    assert gie_metrics.gauges(pb.LoadReport(role="prefill")) == (0, 0, 0.0)
    # Before the engine has said its capacity: no division by zero, nothing in use.
    assert gie_metrics.gauges(pb.LoadReport(role="decode")) == (0, 0, 0.0)
    full = pb.LoadReport(role="decode", running=2, kv_free_tokens=0, kv_capacity_tokens=64)
    assert gie_metrics.gauges(full) == (0, 2, 1.0)
