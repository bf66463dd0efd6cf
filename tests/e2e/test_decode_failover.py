"""Decode failover with real processes and the real model: kill -9 a decode instance under
live requests and every one of them still completes with the text of an undisturbed run.

One cluster (master, store node, 1 prefill, 2 decode, Conductor; prefill writes 2 replicas of
each KV block) serves the module. The tests run in order and each leaves the cluster as the next
expects: the streams test kills one decode, the non-streaming test respawns it and kills one,
the last kills the only decode left.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.transfer.segments import SHM_DIR, cluster_tag
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 64
N_STREAMS = 6

pytestmark = pytest.mark.timeout(900)


def _prompt(seed: int, n_words: int = 120) -> str:
    """Long enough for two full KV blocks: the prompt's KV really comes from the pool."""
    words = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor",
             "island", "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
    body = " ".join(words[(i * 5 + seed * 7 + i // 3) % len(words)] for i in range(n_words))
    return f"Tale {seed}: {body}. And then"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("failover")
    cfg = UpConfig(port=0, prefill=1, decode=2, store_size=256 << 20, store_replicas=2,
                   log_dir=str(d / "logs"), threads=1, ready_timeout_s=300)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0,
                         timeout=300)


def _complete(cluster: LocalCluster, prompt: str, max_tokens: int = MAX_TOKENS
              ) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> dict[int, str]:
    """Each prompt's text in an undisturbed run (greedy, so any run must give it, batched with
    others or not: the references run concurrently, as the streams under test do)."""
    replies: dict[int, tuple[int, dict[str, Any], dict[str, str]]] = {}

    def one(i: int) -> None:
        replies[i] = _complete(cluster, _prompt(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_STREAMS + 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(replies) == list(range(N_STREAMS + 2))
    out = {}
    for i, (status, body, _) in replies.items():
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        out[i] = body["choices"][0]["text"]
    return out


def _stream(cluster: LocalCluster, i: int, out: dict[str, Any]) -> None:
    out.update(pieces=[], error=None, decode=None, usage=None)
    try:
        raw = _client(cluster).completions.with_raw_response.create(
            model=MODEL, prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        out["decode"] = raw.headers.get("x-mooncake-decode")
        for ch in raw.parse():
            if ch.choices:
                out["pieces"].append(ch.choices[0].text)
            if ch.usage is not None:
                out["usage"] = ch.usage
    except openai.APIError as e:
        out["error"] = e


def _conductor_metric(cluster: LocalCluster, name: str, labels: str = "") -> float:
    return metric_value(cluster.procs["conductor"].metrics(), name, labels)


def _wait_decodes_ready(cluster: LocalCluster, n: int) -> None:
    deadline = time.monotonic() + 300
    while _conductor_metric(cluster, "mooncake_conductor_instances",
                            'role="decode",state="ready"') < n:
        assert time.monotonic() < deadline, "the Conductor never saw the decode instances"
        time.sleep(0.2)


def test_killed_decode_streams_resume_with_the_undisturbed_text(
        cluster: LocalCluster, reference: dict[int, str]) -> None:
    results: dict[int, dict[str, Any]] = {i: {"pieces": []} for i in range(N_STREAMS)}
    threads = [threading.Thread(target=_stream, args=(cluster, i, results[i]))
               for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(r["pieces"]) >= 4 for r in results.values()):
        assert time.monotonic() < deadline, results
        assert not any(r.get("error") for r in results.values()), results
        time.sleep(0.02)
    victim = results[0]["decode"]
    assert victim in ("decode-0", "decode-1"), results[0]
    cluster.kill(victim)
    for t in threads:
        t.join(timeout=300)
    on_victim = [i for i, r in results.items() if r["decode"] == victim]
    assert on_victim
    for i, r in results.items():
        assert r["error"] is None, (i, r["error"])
        # One uninterrupted stream: every token once (one chunk per token), the same text.
        assert len(r["pieces"]) == MAX_TOKENS, (i, len(r["pieces"]))
        assert "".join(r["pieces"]) == reference[i], (i, r["decode"])
        assert r["usage"].completion_tokens == MAX_TOKENS
    assert _conductor_metric(cluster, "mooncake_conductor_resumes_total",
                             'outcome="ok"') >= len(on_victim)
    assert _conductor_metric(cluster, "mooncake_conductor_resume_seconds_count") >= len(
        on_victim)
    assert _conductor_metric(cluster, "mooncake_conductor_resumes_total",
                             'outcome="failed"') == 0


def _decode_tokens(cluster: LocalCluster, name: str) -> float:
    return metric_value(cluster.procs[name].metrics(), "mooncake_decode_tokens_total")


def test_non_streaming_request_is_resumed(cluster: LocalCluster,
                                          reference: dict[int, str]) -> None:
    dead = next(n for n in ("decode-0", "decode-1") if not cluster.procs[n].alive())
    cluster.respawn(dead)
    cluster.wait_ready()
    _wait_decodes_ready(cluster, 2)
    # The respawned decode took over the segment its killed predecessor left: one per decode.
    shm = glob.glob(os.path.join(SHM_DIR, f"mooncake-{cluster_tag([cluster.master])}-decode-*"))
    assert sorted(os.path.basename(f).split("-", 2)[2] for f in shm) == [
        "decode-decode-0-dram-0", "decode-decode-1-dram-0"], shm
    assert {os.path.getsize(f) for f in shm} == {cluster.config.decode_segment_size}
    names = ("decode-0", "decode-1")
    before = {n: _decode_tokens(cluster, n) for n in names}
    i = N_STREAMS  # a prompt no earlier test ran while decoding
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(
        zip(("status", "body", "headers"), _complete(cluster, _prompt(i)), strict=True)))
    t.start()
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert time.monotonic() < deadline and t.is_alive(), got
        victim = next((n for n in names if _decode_tokens(cluster, n) - before[n] >= 4), None)
        time.sleep(0.02)
    cluster.kill(victim)
    t.join(timeout=300)
    assert got["status"] == 200, got
    assert got["body"]["choices"][0]["text"] == reference[i]
    assert got["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    assert got["headers"]["X-Mooncake-Resumes"] == "1"
    assert got["headers"]["X-Mooncake-Decode"] != victim


def test_no_decode_left_ends_the_stream_with_a_clear_error(cluster: LocalCluster) -> None:
    failed_before = _conductor_metric(cluster, "mooncake_conductor_resumes_total",
                                      'outcome="failed"')
    alive = [n for n in ("decode-0", "decode-1") if cluster.procs[n].alive()]
    assert len(alive) == 1
    out: dict[str, Any] = {"pieces": []}
    t = threading.Thread(target=_stream, args=(cluster, N_STREAMS + 1, out))
    t.start()
    deadline = time.monotonic() + 120
    while len(out["pieces"]) < 4:
        assert time.monotonic() < deadline and t.is_alive(), out
        time.sleep(0.02)
    cluster.kill(alive[0])
    t.join(timeout=120)
    assert not t.is_alive(), "the stream hung after its last decode instance died"
    err = out["error"]
    assert isinstance(err, openai.APIError), out
    assert "no decode instance" in str(err) and "left to resume" in str(err), str(err)
    assert 4 <= len(out["pieces"]) < MAX_TOKENS
    assert _conductor_metric(cluster, "mooncake_conductor_resumes_total",
                             'outcome="failed"') == failed_before + 1
