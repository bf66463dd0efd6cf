"""SGLang workers on our KV pool and transfer engine, end to end: real SGLang (on CPU, through our
CPU compatibility layer), the built-in model, real store, a transfer sidecar per worker.

One `mooncake up --engine sglang --sidecar` cluster (master, store node, 2 prefill, 1 decode,
a sidecar beside each worker, Conductor) and one plain SGLang server (no PD, no HiCache: the
reference) serve the module. Worker-level checks drive a prefill instance and the decode
instance as a pair over their real gRPC APIs (as the Conductor does), so which prefill computes
and which reuses is chosen by the test.

Skipped where SGLang is not installed, unless MOONCAKE_REQUIRE_SGLANG is set (CI sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.netutil import free_service_port
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.loading import ensure_builtin
from mooncake_k8s.engine.sglang.server import CPU_FLAGS, CPU_PATH
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import SGLANG_CPU_DEFAULTS, LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
BT = 64

if importlib.util.find_spec("sglang") is None and not os.environ.get("MOONCAKE_REQUIRE_SGLANG"):
    pytest.skip("SGLang is not installed (MOONCAKE_WITH_SGLANG=1 bash scripts/setup.sh)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(900)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _wait_http(url: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def plain_sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SGLang as a user runs it on this CPU, no PD and no HiCache: the reference output."""
    path, _ = ensure_builtin(progress=False)
    port = free_service_port()
    log = open(tmp_path_factory.mktemp("plain") / "sglang.log", "wb")  # noqa: SIM115
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_PATH)}
    flags = [f for i, f in enumerate(CPU_FLAGS)  # minus the HiCache flags and their values
             if not f.startswith("--hicache") and not CPU_FLAGS[i - 1].startswith("--hicache")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(path),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
         "--page-size", str(BT), "--max-total-tokens", "16384", *flags,
         *SGLANG_CPU_DEFAULTS],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, plain_sglang: str
            ) -> Iterator[LocalCluster]:
    cfg = UpConfig(port=0, prefill=2, decode=1, engine="sglang", sidecar=True,
                   store_size=512 << 20, log_dir=str(tmp_path_factory.mktemp("up")),
                   ready_timeout_s=900)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        _wait_http(f"{plain_sglang}/health")
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _reference(plain: str, ids: list[int], max_tokens: int) -> list[int]:
    out = _post(f"{plain}/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    got: list[int] = out["output_ids"]
    return got


def _auth(cluster: LocalCluster) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token}"),)


def _load_report(cluster: LocalCluster, role: str, i: int) -> pb.LoadReport:
    port = (cluster.prefill_ports if role == "prefill" else cluster.decode_ports)[i]
    svc = "Prefill" if role == "prefill" else "Decode"
    call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary(
        f"/mooncake.serving.v1.{svc}/Load",
        request_serializer=pb.LoadRequest.SerializeToString,
        response_deserializer=pb.LoadReport.FromString)
    rep: pb.LoadReport = call(pb.LoadRequest(), metadata=_auth(cluster), timeout=10)
    return rep


def _paired(cluster: LocalCluster, i: int, ids: list[int], max_tokens: int = 4,
            tenant: str = "", ttft: list[float] | None = None
            ) -> tuple[pb.PrefillResponse, list[int]]:
    """Prefill instance `i` and decode-0 as a pair, exactly as the Conductor drives them: the
    decode stream opens first (it waits for the KV), prefill gets the same room. `ttft`, when
    given, gets the prefill call's wall time (the first token's latency) appended."""
    addr = _load_report(cluster, "prefill", i).bootstrap_addr
    room = random.getrandbits(63) or 1
    sampling = pb.Sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dch = grpc.insecure_channel(f"127.0.0.1:{cluster.decode_ports[0]}")
    decode = dch.unary_stream("/mooncake.serving.v1.Decode/Decode",
                              request_serializer=pb.DecodeRequest.SerializeToString,
                              response_deserializer=pb.DecodeChunk.FromString)
    tokens: list[int] = []
    errors: list[BaseException] = []

    def run_decode() -> None:
        try:
            for chunk in decode(pb.DecodeRequest(
                    request_id=f"d-{room}", token_ids=ids, tenant=tenant, sampling=sampling,
                    plan=pb.KVPlan(bootstrap_addr=addr, bootstrap_room=room)),
                    metadata=_auth(cluster),
                    timeout=300):
                tokens.append(chunk.token_id)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run_decode)
    t.start()
    pch = grpc.insecure_channel(f"127.0.0.1:{cluster.prefill_ports[i]}")
    prefill = pch.unary_unary("/mooncake.serving.v1.Prefill/Prefill",
                              request_serializer=pb.PrefillRequest.SerializeToString,
                              response_deserializer=pb.PrefillResponse.FromString)
    t0 = time.monotonic()
    resp: pb.PrefillResponse = prefill(pb.PrefillRequest(
        request_id=f"p-{room}", token_ids=ids, tenant=tenant, sampling=sampling,
        use_prefix_cache=True, plan=pb.KVPlan(bootstrap_addr=addr, bootstrap_room=room)),
        metadata=_auth(cluster), timeout=300)
    if ttft is not None:
        ttft.append(time.monotonic() - t0)
    t.join(300)
    assert not errors, errors
    return resp, [resp.first_token, *tokens]


def _metric(cluster: LocalCluster, name: str, metric: str, labels: str = "") -> float:
    return metric_value(cluster.procs[name].metrics(), metric, labels)


def _pages(cluster: LocalCluster, name: str, outcome: str) -> float:
    return _metric(cluster, name, "mooncake_sglang_hicache_pages_total", f'outcome="{outcome}"')


def _stored(cluster: LocalCluster, keys: list[str]) -> bool:
    with StoreClient(cluster.master, cluster.token) as store:
        return store.exists(keys) == [True] * len(keys)


def _wait_for(cond: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.5)


def test_reports_name_sglang_and_the_pairing_address(cluster: LocalCluster) -> None:
    p, d = _load_report(cluster, "prefill", 0), _load_report(cluster, "decode", 0)
    assert p.engine == d.engine == "sglang"
    assert p.kv_layout == "sglang/layer_first/tp1" and p.block_tokens == BT
    assert p.bootstrap_addr.startswith("127.0.0.1:") and not d.bootstrap_addr
    assert p.ready and d.ready and p.max_context > 0


def test_pd_through_our_transfer_engine_matches_plain_sglang(
        cluster: LocalCluster, client: openai.OpenAI, plain_sglang: str) -> None:
    before = _metric(cluster, "prefill-0", "mooncake_sglang_pd_transfer_bytes_total") + _metric(
        cluster, "prefill-1", "mooncake_sglang_pd_transfer_bytes_total")
    for seed, n in ((1, 5), (2, 300)):
        ids = _ids(seed, n)
        want = _reference(plain_sglang, ids, 12)
        got = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert got.choices[0].text == text
        ref_text = _post(f"{plain_sglang}/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})["text"]
        assert text == ref_text, (text, ref_text, want)
    after = _metric(cluster, "prefill-0", "mooncake_sglang_pd_transfer_bytes_total") + _metric(
        cluster, "prefill-1", "mooncake_sglang_pd_transfer_bytes_total")
    assert after > before  # the KV went prefill → decode through our engine


def test_worker_pair_tokens_match_plain_sglang(cluster: LocalCluster,
                                               plain_sglang: str) -> None:
    ids = _ids(3, 200)
    _, tokens = _paired(cluster, 1, ids, max_tokens=6)
    assert tokens == _reference(plain_sglang, ids, 6)


def test_cross_instance_hit_through_hicache(cluster: LocalCluster, plain_sglang: str) -> None:
    ids = _ids(4, 10 * BT + 9)
    saved = _pages(cluster, "prefill-0", "saved")
    ttft: list[float] = []
    cold, cold_tokens = _paired(cluster, 0, ids, ttft=ttft)
    assert cold.cached_tokens == 0
    _wait_for(lambda: _pages(cluster, "prefill-0", "saved") >= saved + 10)
    p = _load_report(cluster, "prefill", 0)
    keys = block_keys(KeyNamespace(p.model_fingerprint, p.dtype, p.block_tokens,
                                   kv_layout=p.kv_layout), ids)
    with StoreClient(cluster.master, cluster.token) as store:
        assert store.exists(keys) == [True] * len(keys)  # our keys are SGLang's pages
    loaded = _pages(cluster, "prefill-1", "loaded")
    warm, warm_tokens = _paired(cluster, 1, ids, ttft=ttft)  # prefill-1 never saw it
    assert warm.cached_tokens >= 10 * BT - BT  # SGLang's own count of reused tokens
    assert _pages(cluster, "prefill-1", "loaded") >= loaded + 9, [  # and ours
        line for line in cluster.procs["prefill-1"].metrics().splitlines() if "sglang" in line]
    assert warm_tokens == cold_tokens == _reference(plain_sglang, ids, 4)
    _assert_no_stall(*ttft)


def _assert_no_stall(cold_s: float, hit_s: float) -> None:
    """A hit computes a few tokens where the cold run computed them all: it may not take longer
    than twice the cold run of the same prompt, measured minutes apart on the same box (so the
    bound scales with the machine and its load), plus 5 s for a CI box's scheduling noise. A
    correctness bound against a stall (issue 20: a hit waited 53 s against 6 s cold), not a
    performance target: normal hits take a fraction of the cold TTFT."""
    assert hit_s < 2 * cold_s + 5, f"hit TTFT {hit_s:.1f} s against {cold_s:.1f} s cold: a stall"


def test_corrupted_page_is_recomputed(cluster: LocalCluster, plain_sglang: str) -> None:
    ids = _ids(5, 6 * BT + 3)
    _paired(cluster, 0, ids)
    p = _load_report(cluster, "prefill", 0)
    keys = block_keys(KeyNamespace(p.model_fingerprint, p.dtype, p.block_tokens,
                                   kv_layout=p.kv_layout), ids)
    _wait_for(lambda: _stored(cluster, keys))
    with StoreClient(cluster.master, cluster.token) as store:
        obj = bytearray(store.get(keys[0]))
        obj[-100] ^= 0xFF  # one payload byte: the page's seal no longer matches
        store.remove([keys[0]], force=True)
        store.put(keys[0], obj)
    missed = _pages(cluster, "prefill-1", "missed")
    resp, tokens = _paired(cluster, 1, ids)
    assert tokens == _reference(plain_sglang, ids, 4)
    assert resp.cached_tokens < 6 * BT  # not every page came from the pool
    assert _pages(cluster, "prefill-1", "missed") >= missed + 1


def test_sidecar_killed_and_restarted_under_load(cluster: LocalCluster,
                                                 plain_sglang: str) -> None:
    """kill -9 prefill-1's sidecar while requests flow through prefill-1, then restart it with
    the same socket: every request still answers exactly what plain SGLang answers (a pool
    outage costs recomputation, never output), and after the restart pages load again."""
    # 5 pages and more: SGLang asks its L3 only for a miss of at least 256 tokens
    prompts = [_ids(100 + k, 5 * BT + 5) for k in range(6)]
    want = [_reference(plain_sglang, ids, 3) for ids in prompts]
    for ids in prompts[:3]:  # into the pool through prefill-0
        _paired(cluster, 0, ids, max_tokens=3)
    results: list[tuple[int, list[int]]] = []
    stop = threading.Event()

    def load() -> None:
        k = 0
        while not stop.is_set():
            j = k % len(prompts)
            results.append((j, _paired(cluster, 1, prompts[j], max_tokens=3)[1]))
            k += 1

    t = threading.Thread(target=load)
    t.start()
    try:  # each phase lasts until requests completed in it (a busy CI box is slow, not wrong)
        _wait_for(lambda: len(results) >= 1, 120)
        cluster.kill("sidecar-prefill-1")
        down = len(results)
        _wait_for(lambda: len(results) >= down + 2, 120)  # served with the sidecar gone
        cluster.respawn("sidecar-prefill-1")
        _wait_for(lambda: Path(cluster.log_dir / "sidecar-prefill-1.sock").exists())
        up = len(results)
        _wait_for(lambda: len(results) >= up + 2, 120)  # and across its restart
    finally:
        stop.set()
        t.join(300)
    assert len(results) >= 5
    for j, tokens in results:
        assert tokens == want[j]
    assert cluster.procs["prefill-1"].alive(), "a sidecar restart does not take the worker down"
    loaded = _pages(cluster, "prefill-1", "loaded")
    fresh = _ids(200, 5 * BT + 5)
    saved = _pages(cluster, "prefill-0", "saved")
    _paired(cluster, 0, fresh, max_tokens=3)
    _wait_for(lambda: _pages(cluster, "prefill-0", "saved") >= saved + 5)  # written back
    resp, tokens = _paired(cluster, 1, fresh, max_tokens=3)
    assert tokens == _reference(plain_sglang, fresh, 3)
    assert _pages(cluster, "prefill-1", "loaded") > loaded  # reconnected to the new sidecar
    assert resp.cached_tokens > 0


def test_a_request_without_a_pair_gets_a_clear_error(cluster: LocalCluster) -> None:
    pch = grpc.insecure_channel(f"127.0.0.1:{cluster.prefill_ports[0]}")
    prefill = pch.unary_unary("/mooncake.serving.v1.Prefill/Prefill",
                              request_serializer=pb.PrefillRequest.SerializeToString,
                              response_deserializer=pb.PrefillResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        prefill(pb.PrefillRequest(request_id="alone", token_ids=_ids(6, 20),
                                  sampling=pb.Sampling(max_tokens=2)),
                metadata=_auth(cluster), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bootstrap" in (err.value.details() or "")
