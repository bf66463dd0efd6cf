"""Worker liveness notices a hung engine: real `mooncake prefill` / `mooncake decode` processes
with the real built-in model, their engine path hung on purpose through the test-only
MOONCAKE_TEST_HANG_ENGINE, probed over HTTP as the kubelet would.

An idle worker stays alive however long it idles; once a request waits on the hung engine for
longer than --stall-timeout, /healthz answers 503 and says why, while /readyz keeps its own
meaning. The Watchdog's arithmetic is checked on its own with a hand-driven clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.health import Watchdog
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import serving_pb2 as pb

TOKEN = "liveness-test-token"
STALL_S = 3

pytestmark = pytest.mark.timeout(300)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def _until(proc: subprocess.Popen[bytes], check: object, what: str,
           deadline_s: float = 180) -> None:
    """Wait for a state, not a duration: return once `check()` holds; fail if the worker died
    or it never did (the deadline only bounds a broken run)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"never: {what}")


def _worker(role: str, hang: str) -> tuple[subprocess.Popen[bytes], int, int]:
    port, metrics = free_port(), free_port()
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN, "MOONCAKE_TEST_HANG_ENGINE": hang,
           "MOONCAKE_STALL_TIMEOUT": str(STALL_S)}
    # No master is needed: the hang comes before the engine touches the store.
    args = [sys.executable, "-m", "mooncake_k8s.cli", role, "--master", "127.0.0.1:1",
            "--port", str(port), "--metrics-port", str(metrics), "--threads", "1",
            "--log-format", "text", "--local-segment-size", "0"]  # no master: no segment
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port, metrics


@pytest.fixture
def stop() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(30)


def _request(role: str, port: int) -> None:
    """One request into the worker, from a thread: it hangs there for good (the call's own
    deadline ends it once the test is over)."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = serving_rpc.stub(role, ch)
    md = call_metadata(TOKEN)
    sampling = pb.Sampling(max_tokens=4)
    try:
        if role == "prefill":
            stub.Prefill(pb.PrefillRequest(request_id="r1", token_ids=[1, 2, 3, 4],
                                           sampling=sampling), metadata=md, timeout=120)
        else:
            for _ in stub.Decode(pb.DecodeRequest(request_id="r1", token_ids=[1, 2, 3, 4],
                                                  first_token=5, sampling=sampling),
                                 metadata=md, timeout=120):
                pass
    except grpc.RpcError:
        pass
    finally:
        ch.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_hung_engine_fails_liveness(role: str, stop: list[subprocess.Popen[bytes]]) -> None:
    proc, port, metrics = _worker(role, role)
    stop.append(proc)
    _until(proc, lambda: _get(metrics, "/readyz")[0] == 200, "the model loaded")
    # Idle (the hang is armed but nothing waits on the engine): alive, for as long as it idles.
    idle_since = time.monotonic()
    _until(proc, lambda: time.monotonic() - idle_since > STALL_S + 1, "idle past the limit")
    assert _get(metrics, "/healthz") == (200, "ok\n")
    threading.Thread(target=_request, args=(role, port), daemon=True).start()
    _until(proc, lambda: _get(metrics, "/healthz")[0] == 503, "liveness failed")
    code, body = _get(metrics, "/healthz")
    assert code == 503 and "the engine made no progress" in body
    assert f"limit {STALL_S} s" in body
    assert _get(metrics, "/readyz")[0] == 200  # readiness is about serving, not liveness
    assert proc.poll() is None  # the kubelet restarts it, not the worker itself


def test_a_worker_whose_engine_answers_stays_alive(stop: list[subprocess.Popen[bytes]]) -> None:
    """The same request into a prefill worker whose engine is not hung: the call comes back
    (here with an error: no store to write its KV to), and liveness never fails."""
    proc, port, metrics = _worker("prefill", "")
    stop.append(proc)
    _until(proc, lambda: _get(metrics, "/readyz")[0] == 200, "the model loaded")
    _request("prefill", port)
    assert _get(metrics, "/healthz") == (200, "ok\n")
    settled = time.monotonic()
    _until(proc, lambda: time.monotonic() - settled > STALL_S + 1, "past the limit")
    assert _get(metrics, "/healthz") == (200, "ok\n")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_counts_only_waits_without_progress() -> None:
    clock = _Clock()
    w = Watchdog(10, clock)
    clock.now += 500
    assert w.stalled() is None  # idle for long: alive
    with w.waiting():
        clock.now += 9
        assert w.stalled() is None
        # another call comes back meanwhile: the engine moves
        with w.waiting():
            clock.now += 5
        assert w.stalled() is None
        clock.now += 8
        assert w.stalled() is None
        clock.now += 3
        reason = w.stalled()
        assert reason is not None and "no progress for 11 s" in reason
        assert "1 call(s)" in reason
    assert w.stalled() is None  # it came back


def test_watchdog_a_raising_call_is_progress() -> None:
    clock = _Clock()
    w = Watchdog(10, clock)
    with pytest.raises(RuntimeError), w.waiting():
        clock.now += 20
        raise RuntimeError("engine error")
    assert w.stalled() is None
