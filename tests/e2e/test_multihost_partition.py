"""A prefill host partitioned (link down, its processes alive) costs no request.

The cluster runs on the test bed (`mooncake_k8s.testbed`): master, store node, 2 prefill,
2 decode and the Conductor each on its own emulated host with a 1 Gbit/s link, serving the real
model. A prompt is warmed on prefill-0 (its prefix is in prefill-0's segment and a decode's).
Then prefill-0's link goes down, nothing else: no RST, no FIN, its processes keep running, so
every call to it waits for whatever bounds it. Requests sent right then, repeats of the warm
prompt (which the router sends to prefill-0: its host holds the prefix) and new prompts, are all
answered, with the greedy text they have without the partition: the Conductor gives up on the
calls waiting on prefill-0 once it misses its polls, retries them on prefill-1, and says so in
`mooncake_conductor_instances{state="unreachable"}` and `mooncake_conductor_reroutes_total`.
When the link comes back, prefill-0 serves again.

No timing assertion: a hang fails the test through the client's timeout and the test's own.
Needs root and network namespaces (CI has them); without them the bed raises
`TestbedUnavailable` and this fails: it never skips.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig
from mooncake_k8s.up import LocalCluster, UpConfig

pytestmark = pytest.mark.timeout(900)

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
CLIENT_TIMEOUT_S = 150
"""A request that waited out the prefill call's own deadline (600 s) fails here first."""
WARM = [0, 1, 2, 3]
"""Candidates for the prompt warmed on prefill-0 (the first one the router sends there)."""
NEW = [20, 21, 22]
"""Prompts first sent during the partition."""
AFTER = [30, 31, 32, 33]
"""Prompts sent once the link is back (until prefill-0 serves one)."""
REROUTED = 'cause="unreachable",role="prefill"'
"""Calls abandoned on an unreachable prefill instance (labels as exported: sorted by name)."""


def prompt(k: int) -> str:
    """About 400 tokens with the chat template: six full KV blocks of 64."""
    return f"Case {k}. Repeat the last word: " + " ".join(
        WORDS[(i * 7 + i // 5 + k) % 16] for i in range(300))


def _chat(base_url: str, content: str) -> tuple[str, str]:
    """The greedy reply's text and the prefill instance that served it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"{base_url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=CLIENT_TIMEOUT_S) as r:
            reply: dict[str, Any] = json.loads(r.read())
            return (str(reply["choices"][0]["message"]["content"]),
                    r.headers["X-Mooncake-Prefill"])
    except urllib.error.HTTPError as e:  # the answer's body says why
        raise AssertionError(f"HTTP {e.code}: {e.read()[:1000]!r}") from e


def _metrics(base_url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{base_url}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The greedy text of the new and after-partition prompts through `mooncake up`'s cluster
    on loopback (equal to the bed's: tests/e2e/test_multihost.py)."""
    d = tmp_path_factory.mktemp("one-host")
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=str(d),
                   threads=1, ready_timeout_s=240)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        return {k: _chat(c.base_url, prompt(k))[0] for k in NEW + AFTER}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BedCluster]:
    d = tmp_path_factory.mktemp("bed")
    with Testbed() as bed, BedCluster(bed, BedConfig(prefill=2, decode=2, rate="1gbit",
                                                     log_dir=str(d), ready_timeout_s=240),
                                      echo=lambda _m: None) as c:
        yield c


def _metric(c: BedCluster, name: str, labels: str) -> float:
    return metric_value(c.client_call(_metrics, c.base_url), name, labels)


def _until_prefills(c: BedCluster, state: str, n: int) -> None:
    """Wait for the Conductor to count `n` prefill instances in `state` (the deadline bounds a
    broken run only)."""
    deadline = time.monotonic() + 120
    labels = f'role="prefill",state="{state}"'
    while _metric(c, "mooncake_conductor_instances", labels) != n:
        assert time.monotonic() < deadline, f"the Conductor never saw {n} prefill {state}"
        c.check_alive()
        time.sleep(0.5)


def _warm_on_prefill0(c: BedCluster) -> tuple[int, str]:
    """A prompt computed on prefill-0, and its greedy text."""
    for k in WARM:
        text, served = c.client_call(_chat, c.base_url, prompt(k))
        if served == "prefill-0":
            return k, text
    raise AssertionError(f"the router sent none of prompts {WARM} to prefill-0")


def test_a_partitioned_prefill_host_costs_no_request(one_host: dict[int, str],
                                                     cluster: BedCluster) -> None:
    c = cluster
    _until_prefills(c, "ready", 2)
    warm, warm_text = _warm_on_prefill0(c)
    # The repeat before the partition: served from prefill-0's host, same text.
    assert c.client_call(_chat, c.base_url, prompt(warm)) == (warm_text, "prefill-0")
    before = c.client_call(_metrics, c.base_url)
    assert REROUTED in before, "the reroute counter is exported before any partition"
    assert metric_value(before, "mooncake_conductor_reroutes_total", REROUTED) == 0

    c.hosts["prefill-0"].set_link(up=False)  # the processes on prefill-0 keep running
    # At once, before the Conductor has missed a poll: the repeats go to prefill-0 (its host
    # holds the prefix) and must be moved; the new prompts go wherever the router says.
    work = [warm, NEW[0], warm, NEW[1], warm, NEW[2]]
    with ThreadPoolExecutor(len(work)) as pool:
        replies = list(pool.map(lambda k: c.client_call(_chat, c.base_url, prompt(k)), work))
    expected = {warm: warm_text, **one_host}
    for k, (text, served) in zip(work, replies, strict=True):
        assert text == expected[k], (k, text, expected[k])
        assert served == "prefill-1", (k, served)
    # Sequential requests while the link is still down: routed around it from the start.
    for k in (warm, NEW[0]):
        assert c.client_call(_chat, c.base_url, prompt(k)) == (expected[k], "prefill-1")
    text = c.client_call(_metrics, c.base_url)
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="prefill",state="unreachable"') == 1
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="prefill",state="ready"') == 1
    # The calls already waiting on prefill-0 were abandoned and retried, not waited out.
    assert metric_value(text, "mooncake_conductor_reroutes_total", REROUTED) >= 1, text
    assert metric_value(text, "mooncake_conductor_requests_total", 'status="200"') > 0
    assert metric_value(text, "mooncake_conductor_requests_total", 'status="5') == 0

    c.hosts["prefill-0"].set_link(up=True)
    _until_prefills(c, "ready", 2)
    served_by = []
    for k in AFTER:  # new prompts: an idle prefill-0 gets one soon
        text, served = c.client_call(_chat, c.base_url, prompt(k))
        assert text == one_host[k], (k, text, one_host[k])
        served_by.append(served)
        if served == "prefill-0":
            break
    assert "prefill-0" in served_by, served_by
    c.check_alive()
