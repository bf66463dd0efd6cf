"""Conductor replicas with real processes and the real model: a Conductor killed (-9) and
started again loads the store's contents before it says ready, so its first repeat of a long
prompt is served from the cache; two Conductors over one cluster agree on what is cached and
keep their decode bookings within the bound of `serving.bookings`.

One cluster (master, store node, 1 prefill, 2 decode, Conductor "A") serves the module; the
second test starts Conductor "B" beside A, with the same arguments on other ports.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from mooncake_k8s.common import auth, serving_rpc
from mooncake_k8s.common.netutil import free_service_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(600)

_WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
          "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie", "quartz", "river"]


def _prompt(seed: int, n_words: int) -> str:
    body = " ".join(_WORDS[(i * 7 + seed * 11 + i // 5) % len(_WORDS)] for i in range(n_words))
    return f"Log {seed}: {body}. Next"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("warm")
    cfg = UpConfig(port=0, prefill=1, decode=2, store_size=256 << 20, store_replicas=1,
                   log_dir=str(d / "logs"), threads=1, ready_timeout_s=300)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


def _complete(base_url: str, prompt: str, max_tokens: int = 4
              ) -> tuple[dict[str, Any], dict[str, str]]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}


def _wait_ready(proc: Proc, timeout: float = 120) -> None:
    """Until /readyz says 200: the Conductor's KV index holds the store's snapshot by then."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.alive(), proc.log()[-3000:]
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{proc.metrics_port}/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, proc.log()[-3000:]
        time.sleep(0.1)


def test_restarted_conductor_routes_a_repeat_to_its_cached_prefix(cluster: LocalCluster) -> None:
    prompt = _prompt(1, 1100)  # about 1.5K tokens: most of the model's 2K context
    first, _ = _complete(cluster.base_url, prompt)
    n = first["usage"]["prompt_tokens"]
    assert n >= 1200, n
    cluster.kill("conductor")  # SIGKILL: nothing is handed over, the index is lost
    _wait_ready(cluster.respawn("conductor"))
    assert _index_blocks(cluster.base_url) >= n // 64  # the snapshot, before any request
    again, headers = _complete(cluster.base_url, prompt)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The Conductor's own plan says the prefix is there (it routed to the holder: the prefill
    # instance's host holds every block) and the prefill really reused it.
    assert int(headers["x-mooncake-cached-tokens"]) >= 0.9 * n, headers
    assert cached >= 0.9 * n, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def _start_second(cluster: LocalCluster) -> tuple[Proc, str]:
    a = cluster.procs["conductor"]
    port, mport = free_service_port("127.0.0.1"), free_service_port("127.0.0.1")
    args = list(a.args)
    args[args.index("--port") + 1] = str(port)
    args[args.index("--metrics-port") + 1] = str(mport)
    return cluster._spawn("conductor-b", args, mport), f"http://127.0.0.1:{port}"


def _index_blocks(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), "mooncake_conductor_kv_index_blocks")


def _until_indexed(base_url: str, blocks: float) -> None:
    deadline = time.monotonic() + 30
    while _index_blocks(base_url) < blocks:
        assert time.monotonic() < deadline, (base_url, blocks)
        time.sleep(0.05)


def _accepted(cluster: LocalCluster) -> dict[str, int]:
    """Each decode instance's `accepted_streams`, asked directly (gRPC `Load`)."""
    out = {}
    for port in cluster.decode_ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            rep: pb.LoadReport = serving_rpc.stub("decode", ch).Load(
                pb.LoadRequest(), metadata=auth.call_metadata(cluster.token), timeout=10)
        out[rep.instance_id] = int(rep.accepted_streams)
    return out


def _stream(base_url: str, prompt: str, out: dict[str, Any], started: threading.Event) -> None:
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                               timeout=300)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        out["decode"] = raw.headers.get("x-mooncake-decode")
        for ch in raw.parse():
            if ch.choices:
                out.setdefault("tokens", 0)
                out["tokens"] += 1
                started.set()
    except Exception as e:  # reported by the test's assertions
        out["error"] = e
    finally:
        started.set()


def test_two_conductors_agree_and_bound_decode_bookings(cluster: LocalCluster) -> None:
    proc_b, url_b = _start_second(cluster)
    _wait_ready(proc_b)
    url_a = cluster.base_url
    # Each learns from the store what the other caused to be stored: a prompt served by one
    # is a cached repeat on the other, routed to the same prefill instance.
    for i, (one, other) in enumerate([(url_a, url_b), (url_b, url_a)]):
        prompt = _prompt(10 + i, 250)
        body, h1 = _complete(one, prompt)
        n = body["usage"]["prompt_tokens"]
        # Store events reach the other Conductor asynchronously: wait until it indexes as
        # many blocks as the first one (both follow the same store).
        _until_indexed(other, _index_blocks(one))
        again, h2 = _complete(other, prompt)
        # Every full block of the prompt (64 tokens each) came from the cache.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 64 * 64, i
        assert h1["x-mooncake-prefill"] == h2["x-mooncake-prefill"]
    # Streams opened alternately through A and B, each once the one before is running. A
    # Conductor undercounts an instance by at most the other's admissions since its latest
    # poll (one here), so neither instance gets more than 3 of the 4; the decodes' own
    # counters (what the Conductors reconcile their bookings with) saw exactly the 4.
    before = _accepted(cluster)
    results: list[dict[str, Any]] = []
    threads = []
    for i in range(4):
        out: dict[str, Any] = {}
        started = threading.Event()
        t = threading.Thread(target=_stream, args=((url_a, url_b)[i % 2], _prompt(20 + i, 200),
                                                   out, started))
        t.start()
        assert started.wait(120), "no first token"
        results.append(out)
        threads.append(t)
    for t in threads:
        t.join(300)
    assert all("error" not in r and r.get("tokens") == 40 for r in results), results
    per = {d: sum(r["decode"] == d for r in results) for d in before}
    assert max(per.values()) <= 3, per
    after = _accepted(cluster)
    assert {d: after[d] - before[d] for d in before} == per
