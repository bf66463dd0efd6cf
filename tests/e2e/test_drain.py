"""Pods come and go, with real processes and the real model: a decode frozen mid-stream
(SIGSTOP) and one told to stop (SIGTERM) under live streams; every stream completes with the
text of an undisturbed run, each token once.

One cluster (master, store node, 1 prefill, 2 decode, Conductor; prefill writes 2 replicas of
each KV block) serves the module, its workers with a short drain grace (`--drain-timeout`) so a
stopped decode hands its streams over rather than finishing them. The tests run in order: the
frozen decode is thawed and back in rotation before the second test stops one for good.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
N_STREAMS = 4
DRAIN_S = 1.0
"""The workers' grace: far shorter than a stream's remaining tokens, so streams are handed
over, not finished, by the stopped decode."""

pytestmark = pytest.mark.timeout(600)


def _prompt(seed: int, n_words: int = 120) -> str:
    """Two full KV blocks and a partial one: the continuation loads blocks and a tail."""
    words = ["quartz", "river", "saffron", "tundra", "umber", "violet", "willow", "xenon",
             "yarrow", "zephyr", "acorn", "bramble", "cedar", "delta", "egret", "fennel"]
    body = " ".join(words[(i * 3 + seed * 5 + i // 4) % len(words)] for i in range(n_words))
    return f"Story {seed}: {body}. Then"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("drain")
    cfg = UpConfig(port=0, prefill=1, decode=2, store_size=256 << 20, store_replicas=2,
                   log_dir=str(d / "logs"), threads=1, ready_timeout_s=300,
                   drain_timeout_s=DRAIN_S)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        try:
            yield c
        finally:  # a frozen process ignores the SIGTERM that stops the cluster
            for p in c.procs.values():
                if p.alive():
                    os.killpg(p.popen.pid, signal.SIGCONT)


def _complete(cluster: LocalCluster, prompt: str) -> str:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
    return str(out["choices"][0]["text"])


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> dict[int, str]:
    """Each prompt's text in an undisturbed run (greedy, so every run must give it)."""
    out: dict[int, str] = {}

    def one(i: int) -> None:
        out[i] = _complete(cluster, _prompt(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(out) == list(range(N_STREAMS))
    return out


def _stream(cluster: LocalCluster, i: int, out: dict[str, Any]) -> None:
    try:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none",
                               max_retries=0, timeout=300)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        out["decode"] = raw.headers.get("x-mooncake-decode")
        for ch in raw.parse():
            if ch.choices:
                out["pieces"].append(ch.choices[0].text)
    except openai.APIError as e:
        out["error"] = e


def _start_streams(cluster: LocalCluster) -> tuple[dict[int, dict[str, Any]],
                                                   list[threading.Thread]]:
    """N live streams, returned once each has a few tokens (all are mid-stream)."""
    results: dict[int, dict[str, Any]] = {
        i: {"pieces": [], "error": None, "decode": None} for i in range(N_STREAMS)}
    threads = [threading.Thread(target=_stream, args=(cluster, i, results[i]))
               for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(r["pieces"]) >= 4 for r in results.values()):
        assert time.monotonic() < deadline, results
        assert not any(r["error"] for r in results.values()), results
        time.sleep(0.02)
    return results, threads


def _check_streams(results: dict[int, dict[str, Any]], threads: list[threading.Thread],
                   reference: dict[int, str]) -> None:
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    for i, r in results.items():
        assert r["error"] is None, (i, r["error"])
        # One uninterrupted stream: every token once (one chunk per token), the same text.
        assert len(r["pieces"]) == MAX_TOKENS, (i, len(r["pieces"]))
        assert "".join(r["pieces"]) == reference[i], (i, r["decode"])


def _metric(cluster: LocalCluster, name: str, labels: str = "") -> float:
    return metric_value(cluster.procs["conductor"].metrics(), name, labels)


def _wait_decodes_ready(cluster: LocalCluster, n: int) -> None:
    deadline = time.monotonic() + 120
    while _metric(cluster, "mooncake_conductor_instances", 'role="decode",state="ready"') < n:
        assert time.monotonic() < deadline, f"fewer than {n} decode instances in rotation"
        time.sleep(0.2)


def test_a_frozen_decode_s_streams_resume_elsewhere_and_it_comes_back(
        cluster: LocalCluster, reference: dict[int, str]) -> None:
    _wait_decodes_ready(cluster, 2)
    results, threads = _start_streams(cluster)
    victim = results[0]["decode"]
    assert victim in ("decode-0", "decode-1"), results[0]
    pid = cluster.procs[victim].popen.pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        # Every stream ends, complete, while the victim is still frozen: its streams did not
        # wait for it (the per-token deadline gave up on it and they resumed elsewhere).
        _check_streams(results, threads, reference)
        assert _metric(cluster, "mooncake_conductor_stream_stalls_total") >= 1
        on_victim = [i for i, r in results.items() if r["decode"] == victim]
        assert _metric(cluster, "mooncake_conductor_resumes_total",
                       'outcome="ok"') >= len(on_victim) >= 1
        assert _metric(cluster, "mooncake_conductor_reroutes_total",
                       'cause="stalled",role="decode"') >= 1
    finally:
        os.killpg(pid, signal.SIGCONT)
    # Thawed, it answers its polls and is routed to again.
    _wait_decodes_ready(cluster, 2)
    assert _metric(cluster, "mooncake_conductor_resumes_total", 'outcome="failed"') == 0


def test_a_stopped_decode_hands_its_streams_over(
        cluster: LocalCluster, reference: dict[int, str]) -> None:
    _wait_decodes_ready(cluster, 2)
    results, threads = _start_streams(cluster)
    victim = results[0]["decode"]
    assert victim in ("decode-0", "decode-1"), results[0]
    resumed = _metric(cluster, "mooncake_conductor_resumes_total", 'outcome="ok"')
    proc = cluster.procs[victim].popen
    os.killpg(proc.pid, signal.SIGTERM)
    _check_streams(results, threads, reference)
    assert proc.wait(timeout=60) == 0  # drained and exited cleanly
    # Continued from the KV the stopped decode stored (a stream that fit in the grace may have
    # finished there): none took the failover path (re-prefill) or broke.
    handed = _metric(cluster, "mooncake_conductor_handoffs_total", 'outcome="ok"')
    assert handed >= 1
    assert _metric(cluster, "mooncake_conductor_handoff_stall_seconds_count") == handed
    assert _metric(cluster, "mooncake_conductor_handoffs_total", 'outcome="fallback"') == 0
    assert _metric(cluster, "mooncake_conductor_handoffs_total", 'outcome="failed"') == 0
    assert _metric(cluster, "mooncake_conductor_resumes_total", 'outcome="ok"') == resumed
