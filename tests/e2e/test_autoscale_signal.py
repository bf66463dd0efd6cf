"""The autoscaler's decode signal, read from a real Conductor under a decode-bound load.

A `mooncake up` cluster (1 prefill, 1 decode, the built-in model on the CPU) runs with a decode
batch of 2 sequences. Eight concurrent requests with 100-word prompts and long generations
keep prefill's queue far under its target while decode holds two sequences' KV and queues the
rest: the load is on decode. The test scrapes the Conductor's own /metrics while that lasts,
feeds the text to the operator's `sample_from_texts` and `decide` (what the operator does with
every Conductor pod's /metrics), and checks that decode replicas go up and prefill does not;
once the requests are done the same path reads an idle decode and scales it back down.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from mooncake_k8s.operator.autoscaler import Policy, ScalerState, decide, sample_from_texts
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
REQUESTS = 4  # batch 2: two run while two wait at decode, the decode-bound moment
MAX_TOKENS = 48
DECODE_BATCH = 2
PROMPT_WORDS = 100
#: Per decode pod: under what any moment with a sequence waiting shows (one running sequence
#: reserves its prompt, over 100 tokens, plus MAX_TOKENS - 1; a waiting one adds its prompt).
TARGET_DECODE_TOKENS = 256

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("autoscale")
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=str(d / "logs"),
                   threads=1, ready_timeout_s=300,
                   extra_env={"MOONCAKE_MAX_BATCH": str(DECODE_BATCH)})
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


def _policy() -> Policy:
    return Policy(prefill_min=1, prefill_max=8, decode_min=1, decode_max=8, ratio_min=0.1,
                  ratio_max=4.0, target_prefill_tokens=8192,
                  target_decode_tokens=TARGET_DECODE_TOKENS, max_rejection_rate=0.05,
                  up_window_s=0.0, down_window_s=0.0, ttft_slo_ms=60_000.0)


def _complete(cluster: LocalCluster, i: int, out: dict[int, int]) -> None:
    words = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor"]
    story = " ".join(words[(j * 3 + i) % len(words)] for j in range(PROMPT_WORDS))
    prompt = f"Request {i}: {story}. Go on:"
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out[i] = json.loads(r.read())["usage"]["completion_tokens"]


def _scrape_until(cluster: LocalCluster, cond: Callable[[str], bool], what: str) -> str:
    """The Conductor's /metrics text once `cond` holds (the deadline only guards a hang)."""
    deadline = time.monotonic() + 240
    while True:
        text = cluster.procs["conductor"].metrics()
        if cond(text):
            return text
        assert time.monotonic() < deadline, f"the Conductor never reported {what}"
        time.sleep(0.1)


def test_decode_bound_load_scales_decode_up_with_the_real_metric(cluster: LocalCluster) -> None:
    done: dict[int, int] = {}
    threads = [threading.Thread(target=_complete, args=(cluster, i, done))
               for i in range(REQUESTS)]
    for t in threads:
        t.start()

    def full_batch_and_waiting(text: str) -> bool:
        queued = metric_value(text, "mooncake_conductor_queue_tokens", 'role="decode"')
        # The load is more than what waits: the running sequences' KV counts too.
        return 0 < queued < metric_value(text, "mooncake_conductor_decode_load_tokens")

    try:
        # Sequences running and more waiting at decode: the decode-bound moment.
        busy = _scrape_until(cluster, full_batch_and_waiting, "sequences waiting at decode")
    finally:
        for t in threads:
            t.join(300)
    assert sorted(done) == list(range(REQUESTS))
    assert set(done.values()) == {MAX_TOKENS}

    load = metric_value(busy, "mooncake_conductor_decode_load_tokens")
    sample = sample_from_texts([busy], now=0.0)
    assert sample is not None and sample.decode_load_tokens == load
    pol = _policy()
    # Prefill works through the burst well within its target: the pressure is on decode.
    assert sample.prefill_queue_tokens < pol.target_prefill_tokens
    state = ScalerState()
    up = decide(pol, (1, 1), state, sample, ready=(1, 1))
    assert up.decode > 1, up.reason
    assert up.prefill == 1, up.reason  # the load is on decode, not prefill
    assert up.decode == -(-int(load) // TARGET_DECODE_TOKENS) or up.decode == pol.decode_max

    # Everything finished: decode holds nothing, and the same path scales it back down.
    idle = _scrape_until(cluster, lambda t: metric_value(
        t, "mooncake_conductor_decode_load_tokens") == 0, "an idle decode")
    idle_sample = sample_from_texts([idle], now=15.0)
    assert idle_sample is not None
    down = decide(pol, (up.prefill, up.decode), state, idle_sample,
                  ready=(up.prefill, up.decode))
    assert (down.prefill, down.decode) == (1, 1), down.reason
