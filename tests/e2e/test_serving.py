"""The whole serving path as `mooncake up` runs it: real processes, the real model, real store.

One cluster (master, store node, 1 prefill, 2 decode, Conductor) serves the module; the test
that kills a decode instance (whose streams then resume on the other) runs last.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from mooncake_k8s.common import auth, serving_rpc
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "sk-test-tenant-a", "sk-test-tenant-b"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("up")
    keys = d / "keys.txt"
    keys.write_text(f"# key tenant\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    cfg = UpConfig(port=0, prefill=1, decode=2, store_size=512 << 20, api_keys_file=str(keys),
                   log_dir=str(d / "logs"), threads=1, ready_timeout_s=300,
                   extra_env={"MOONCAKE_TRACE_FILE": str(d / "spans.jsonl")})
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY_A, max_retries=0,
                         timeout=300)


def _post(cluster: LocalCluster, path: str, body: bytes | dict[str, Any], key: str = KEY_A
          ) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{cluster.base_url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metrics(cluster: LocalCluster, name: str) -> str:
    return cluster.procs[name].metrics()


def _long_prompt(seed: int, n_words: int = 400) -> str:
    words = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor",
             "island", "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
    return " ".join(words[(i * 7 + seed * 3 + i // 5) % len(words)] for i in range(n_words))


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count: one, two, three,"}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals and finals[-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_completion_with_token_ids_exact_length(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=list(range(100, 200)), max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage is not None
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) == 5


def test_wrong_or_missing_key_is_401(cluster: LocalCluster) -> None:
    bad = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "Incorrect API key" in str(e.value)
    status, body = _post(cluster, "/v1/completions", {"model": MODEL, "prompt": "x"}, key="")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-9"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n > 1"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": MODEL, "prompt": list(range(20, 9020))}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": [60000]}, 400, "vocabulary"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "maximum context length"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_specific_4xx(cluster: LocalCluster, body: dict[str, Any],
                                       status: int, fragment: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got, resp = _post(cluster, path, body)
    assert got == status, resp
    assert fragment in resp["error"]["message"] or fragment == resp["error"].get("param")


def test_invalid_json_is_400_and_server_keeps_serving(
        cluster: LocalCluster, client: openai.OpenAI) -> None:
    status, body = _post(cluster, "/v1/chat/completions", b"{not json")
    assert status == 400 and "invalid JSON" in body["error"]["message"]
    status, body = _post(cluster, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert r.choices[0].text is not None


def _ttft_and_text(client: openai.OpenAI, prompt: str, max_tokens: int = 16
                   ) -> tuple[float, str, int]:
    t0 = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    ttft = None
    text = []
    cached = -1
    for c in stream:
        if c.choices and ttft is None:
            ttft = time.monotonic() - t0
        if c.choices:
            text.append(c.choices[0].text)
        if c.usage is not None:
            details = c.usage.prompt_tokens_details
            cached = details.cached_tokens if details and details.cached_tokens else 0
    assert ttft is not None
    return ttft, "".join(text), cached


def test_prefix_hit_is_identical_and_counted(cluster: LocalCluster,
                                             client: openai.OpenAI) -> None:
    prompt = _long_prompt(1, 700)
    before = metric_value(_metrics(cluster, "conductor"),
                          "mooncake_conductor_prompt_tokens_cached_total")
    _, cold_text, cold_cached = _ttft_and_text(client, prompt)
    _, hit_text, hit_cached = _ttft_and_text(client, prompt)
    assert cold_cached == 0
    assert hit_cached >= 640  # every full 64-token block of a ~700-token prompt
    assert hit_text == cold_text  # greedy: identical whether KV was imported or computed
    after = metric_value(_metrics(cluster, "conductor"),
                         "mooncake_conductor_prompt_tokens_cached_total")
    assert after - before == hit_cached


def test_kv_really_moves_through_the_store(cluster: LocalCluster,
                                           client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=_long_prompt(2, 300), max_tokens=3)
    prefill = _metrics(cluster, "prefill-0")
    assert metric_value(prefill, "mooncake_prefill_blocks_total", 'outcome="stored"') > 0
    loaded = sum(metric_value(_metrics(cluster, f"decode-{i}"),
                              "mooncake_decode_kv_bytes_total") for i in range(2))
    assert loaded > 0
    master = _metrics(cluster, "master")
    assert "mooncake_master" in master


def test_tenants_never_share_blocks(cluster: LocalCluster, client: openai.OpenAI) -> None:
    prompt = _long_prompt(3, 400)
    _ttft_and_text(client, prompt)
    _, _, cached_same_tenant = _ttft_and_text(client, prompt)
    other = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY_B, max_retries=0,
                          timeout=300)
    _, _, cached_other_tenant = _ttft_and_text(other, prompt)
    assert cached_same_tenant > 0
    assert cached_other_tenant == 0


def test_trace_spans_cross_processes(cluster: LocalCluster, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Trace me", max_tokens=3)
    path = Path(cluster.config.extra_env["MOONCAKE_TRACE_FILE"])
    deadline = time.monotonic() + 10
    while True:
        spans = [json.loads(line) for line in path.read_text().splitlines() if line]
        by_trace: dict[str, set[str]] = {}
        for s in spans:
            by_trace.setdefault(s["trace_id"], set()).add(s["name"])
        full = [t for t, names in by_trace.items()
                if {"conductor.request", "prefill", "prefill.load_kv", "decode.load_kv"} <= names]
        if full or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert full, by_trace


def _plans(cluster: LocalCluster, role: str, n: int, outcome: str) -> float:
    return sum(metric_value(_metrics(cluster, f"{role}-{i}"), f"mooncake_{role}_plans_total",
                            f'outcome="{outcome}"') for i in range(n))


def test_the_plan_reaches_decode_as_prefill_got_it(cluster: LocalCluster,
                                                  client: openai.OpenAI) -> None:
    """The Conductor's one KVPlan goes unchanged to prefill and to decode (DecodeRequest.plan),
    and both judge it by the same rule: both follow it (decode loads the Conductor's keys)."""
    before = [_plans(cluster, r, n, o) for r, n in (("prefill", 1), ("decode", 2))
              for o in ("followed", "untrusted")]
    r = client.completions.create(model=MODEL, prompt=_long_prompt(4, 300), max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 3
    after = [_plans(cluster, r, n, o) for r, n in (("prefill", 1), ("decode", 2))
             for o in ("followed", "untrusted")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0, 1, 0]


def test_a_malformed_plan_is_refused_by_both_workers(cluster: LocalCluster) -> None:
    """Two blocks to reuse of one key: no namespace can make sense of it. The one place that
    judges plans refuses it, and each worker answers INVALID_ARGUMENT naming the fault."""
    plan = pb.KVPlan(block_keys=["0" * 32], namespace="ab" * 16, local_blocks=1,
                     fetch_blocks=1, planned=True)
    sampling = pb.Sampling(temperature=0, max_tokens=2)
    md = auth.call_metadata(cluster.token)
    host = cluster.config.host
    prefill = pb.PrefillRequest(request_id="bad-plan-p", token_ids=[1, 2, 3],
                                sampling=sampling, plan=plan)
    decode = pb.DecodeRequest(request_id="bad-plan-d", token_ids=[1, 2, 3], first_token=4,
                              sampling=sampling, plan=plan)
    for role, port in (("prefill", cluster.prefill_ports[0]), ("decode", cluster.decode_ports[0])):
        with grpc.insecure_channel(f"{host}:{port}") as ch, \
                pytest.raises(grpc.RpcError) as err:
            stub: Any = serving_rpc.stub(role, ch)
            if role == "prefill":
                stub.Prefill(prefill, metadata=md, timeout=60)
            else:
                list(stub.Decode(decode, metadata=md, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, role
        assert "malformed KV plan: local_blocks + fetch_blocks = 2 but only 1" in (
            err.value.details() or ""), role


def test_readyz_and_metrics(cluster: LocalCluster) -> None:
    with urllib.request.urlopen(f"{cluster.base_url}/readyz", timeout=5) as r:
        assert r.status == 200
    text = _metrics(cluster, "conductor")
    assert metric_value(text, "mooncake_conductor_requests_total", 'status="200"') > 0
    assert metric_value(text, "mooncake_conductor_ttft_seconds_count") > 0


def test_killed_decode_streams_resume_others_continue(cluster: LocalCluster) -> None:
    """Run last: kills decode-1. Its streams resume on decode-0 (decode failover: the prompt's
    KV has a second copy in the pool), and every stream ends complete."""
    results: dict[int, dict[str, Any]] = {}

    def stream(i: int) -> None:
        c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY_A, max_retries=0,
                          timeout=300)
        out: dict[str, Any] = {"tokens": 0, "error": None, "decode": None}
        results[i] = out
        try:
            raw = c.completions.with_raw_response.create(
                model=MODEL, prompt=f"Story number {i}:", max_tokens=60, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            out["decode"] = raw.headers.get("x-mooncake-decode")
            for ch in raw.parse():
                if ch.choices:
                    out["tokens"] += 1
        except openai.APIError as e:
            out["error"] = str(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 120
    while not all(r["tokens"] >= 3 for r in results.values()) or len(results) < 4:
        assert time.monotonic() < deadline, results
        time.sleep(0.05)
    cluster.kill("decode-1")
    for t in threads:
        t.join(timeout=300)
    on_dead = [r for r in results.values() if r["decode"] == "decode-1"]
    on_live = [r for r in results.values() if r["decode"] == "decode-0"]
    assert on_dead and on_live, results
    for r in on_dead + on_live:
        assert r["error"] is None and r["tokens"] == 60, r
    assert metric_value(_metrics(cluster, "conductor"), "mooncake_conductor_resumes_total",
                        'outcome="ok"') >= len(on_dead)
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY_A, max_retries=0,
                      timeout=300)
    for _ in range(3):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt="After the crash",
                                                     max_tokens=3)
        assert raw.headers.get("x-mooncake-decode") == "decode-0"
        assert raw.parse().usage is not None
