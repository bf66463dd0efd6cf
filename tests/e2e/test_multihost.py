"""The cluster with every component on its own emulated host (`mooncake_k8s.testbed`): master,
store node, 2 prefill, 2 decode and the Conductor, each with its own address, IPC namespace and a
1 Gbit/s link, serving the real model. One bed cluster and one one-host cluster (`mooncake up`
on 127.0.0.1, the reference for greedy text) serve every test here, in order:

1. the hosts are separate (addresses, shaped links, IPC namespaces);
2. greedy text equals the one-host run's, and the hosts' byte counters show the KV leaving a
   prefill host for a decode host, not passing the Conductor or the master;
3. 1% loss and 10 ms delay on every link (netfilter rules on the bed's bridge, faults.py: this
   kernel has no netem) change no answer, and packets were really lost meanwhile;
4. a prefill host partitioned (link down, its processes alive: no RST, no FIN, every call to it
   waits for whatever bounds it) costs no request: repeats of a prompt warmed there (which the
   router sends to it: its host holds the prefix) and new prompts sent right then are answered
   with their greedy text, the Conductor gives up on the calls waiting on prefill-0 once it
   misses its polls, retries them on prefill-1 and says so in
   `mooncake_conductor_instances{state="unreachable"}` and `mooncake_conductor_reroutes_total`;
   when the link comes back prefill-0 serves again.

No timing assertion: a hang fails a test through the client's timeout and the test's own.
Needs root, network namespaces and iptables (CI has them); without them the bed raises
`TestbedUnavailable` and this fails: it never skips.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig
from mooncake_k8s.up import LocalCluster, UpConfig

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
MB = 1 << 20
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
#: 419 tokens with the chat template: six full KV blocks of 64, 19 MB of KV (fp32 on CPU).
PROMPT = "Repeat the last word: " + " ".join(WORDS[(i * 7 + i // 5) % 16] for i in range(320))
#: About 420 tokens too, other words: its KV crosses the lossy links (test 3).
LONG = "Repeat the last word: " + " ".join(WORDS[(i * 5 + i // 3) % 16] for i in range(320))
FAULTY = [LONG, "Name three colours of the sea.", LONG]
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


def case(k: int) -> str:
    """About 400 tokens with the chat template: six full KV blocks of 64."""
    return f"Case {k}. Repeat the last word: " + " ".join(
        WORDS[(i * 7 + i // 5 + k) % 16] for i in range(300))


def _chat(base_url: str, content: str, max_tokens: int = 8) -> dict[str, Any]:
    """The greedy reply's body, with the prefill instance that served it (`_prefill`)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"{base_url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=CLIENT_TIMEOUT_S) as r:
            reply: dict[str, Any] = json.loads(r.read())
            reply["_prefill"] = r.headers["X-Mooncake-Prefill"]
            return reply
    except urllib.error.HTTPError as e:  # the answer's body says why
        raise AssertionError(f"HTTP {e.code}: {e.read()[:1000]!r}") from e


def _ask(base_url: str, content: str, max_tokens: int = 8) -> tuple[str, str]:
    """(greedy text, the prefill instance that served it)."""
    reply = _chat(base_url, content, max_tokens)
    return str(reply["choices"][0]["message"]["content"]), str(reply["_prefill"])


def _metrics(base_url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{base_url}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mooncake up`'s cluster on loopback (1 prefill, 1 decode): the reference answers."""
    d = tmp_path_factory.mktemp("one-host")
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=str(d),
                   threads=1, ready_timeout_s=240)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c.base_url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BedCluster]:
    d = tmp_path_factory.mktemp("bed")
    with Testbed() as bed, BedCluster(bed, BedConfig(rate="1gbit", log_dir=str(d),
                                                     ready_timeout_s=240),
                                      echo=lambda _m: None) as c:
        yield c


def test_hosts_are_separate(cluster: BedCluster) -> None:
    addrs = {h.addr for h in cluster.hosts.values()}
    assert len(addrs) == len(cluster.hosts) == 7
    qdisc = cluster.hosts["prefill-0"].qdisc()
    assert "rate 1Gbit" in qdisc, qdisc
    ipc = {Path(f"/proc/{p.pid}/ns/ipc").readlink() for p in cluster.procs.values()}
    assert len(ipc) == 7  # own IPC namespaces: the transfer engine's peers are remote


def test_greedy_text_equals_one_host_and_kv_crosses_from_prefill_to_decode(
        cluster: BedCluster, one_host: str) -> None:
    bed = cluster.bed
    before = bed.counters()
    reply = cluster.client_call(_chat, cluster.base_url, PROMPT, 12)
    after = bed.counters()
    text = reply["choices"][0]["message"]["content"]
    assert text == _ask(one_host, PROMPT, 12)[0]
    assert reply["usage"]["prompt_tokens"] >= 320
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    prefill_sent = max(moved[n][0] for n in moved if n.startswith("prefill"))
    decode_received = max(moved[n][1] for n in moved if n.startswith("decode"))
    # 19 MB of KV a copy: one stays on the prefill's host, one crosses to a decode host.
    assert prefill_sent > 8 * MB, moved
    assert decode_received > 4 * MB, moved
    # The KV never passes through the Conductor (the client is on its host) or the master.
    for host in ("conductor", "master"):
        assert sum(moved[host]) < MB, moved


def test_loss_and_delay_change_no_answer(cluster: BedCluster, one_host: str) -> None:
    expected = [_ask(one_host, p, 16)[0] for p in FAULTY]
    hosts = cluster.hosts.values()
    try:
        for h in hosts:
            h.shape(rate="1gbit", delay="10ms", loss="1%")
        for h in hosts:
            rules = h.faults()
            assert "NFQUEUE" in rules and "statistic" in rules, (h.name, rules)
        replies = [cluster.client_call(_ask, cluster.base_url, p, 16)[0] for p in FAULTY]
        dropped = sum(h.dropped() for h in hosts)
    finally:
        for h in hosts:
            h.shape(rate="1gbit")
    assert replies == expected
    assert replies[0] == replies[2]
    assert dropped > 0  # the loss was real while the cluster served


def _until_prefills(c: BedCluster, state: str, n: int) -> None:
    """Wait for the Conductor to count `n` prefill instances in `state` (the deadline bounds a
    broken run only)."""
    deadline = time.monotonic() + 120
    labels = f'role="prefill",state="{state}"'
    while metric_value(c.client_call(_metrics, c.base_url), "mooncake_conductor_instances",
                       labels) != n:
        assert time.monotonic() < deadline, f"the Conductor never saw {n} prefill {state}"
        c.check_alive()
        time.sleep(0.5)


def _warm_on_prefill0(c: BedCluster) -> tuple[int, str]:
    """A prompt computed on prefill-0, and its greedy text."""
    for k in WARM:
        text, served = c.client_call(_ask, c.base_url, case(k))
        if served == "prefill-0":
            return k, text
    raise AssertionError(f"the router sent none of prompts {WARM} to prefill-0")


@pytest.mark.timeout(900)
def test_a_partitioned_prefill_host_costs_no_request(cluster: BedCluster,
                                                     one_host: str) -> None:
    c = cluster
    with ThreadPoolExecutor(len(NEW + AFTER)) as pool:
        expected = dict(zip(NEW + AFTER, (r[0] for r in pool.map(
            lambda k: _ask(one_host, case(k)), NEW + AFTER)), strict=True))
    _until_prefills(c, "ready", 2)
    warm, warm_text = _warm_on_prefill0(c)
    expected[warm] = warm_text
    # The repeat before the partition: served from prefill-0's host, same text.
    assert c.client_call(_ask, c.base_url, case(warm)) == (warm_text, "prefill-0")
    before = c.client_call(_metrics, c.base_url)
    assert REROUTED in before, "the reroute counter is exported before any partition"
    rerouted0 = metric_value(before, "mooncake_conductor_reroutes_total", REROUTED)
    failed0 = metric_value(before, "mooncake_conductor_requests_total", 'status="5')

    c.hosts["prefill-0"].set_link(up=False)  # the processes on prefill-0 keep running
    # At once, before the Conductor has missed a poll: the repeats go to prefill-0 (its host
    # holds the prefix) and must be moved; the new prompts go wherever the router says.
    work = [warm, NEW[0], warm, NEW[1], warm, NEW[2]]
    with ThreadPoolExecutor(len(work)) as pool:
        replies = list(pool.map(lambda k: c.client_call(_ask, c.base_url, case(k)), work))
    for k, (text, served) in zip(work, replies, strict=True):
        assert text == expected[k], (k, text, expected[k])
        assert served == "prefill-1", (k, served)
    # Sequential requests while the link is still down: routed around it from the start.
    for k in (warm, NEW[0]):
        assert c.client_call(_ask, c.base_url, case(k)) == (expected[k], "prefill-1")
    text = c.client_call(_metrics, c.base_url)
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="prefill",state="unreachable"') == 1
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="prefill",state="ready"') == 1
    # The calls already waiting on prefill-0 were abandoned and retried, not waited out.
    assert metric_value(text, "mooncake_conductor_reroutes_total", REROUTED) > rerouted0, text
    assert metric_value(text, "mooncake_conductor_requests_total", 'status="5') == failed0

    c.hosts["prefill-0"].set_link(up=True)
    _until_prefills(c, "ready", 2)
    served_by = []
    for k in AFTER:  # new prompts: an idle prefill-0 gets one soon
        text, served = c.client_call(_ask, c.base_url, case(k))
        assert text == expected[k], (k, text, expected[k])
        served_by.append(served)
        if served == "prefill-0":
            break
    assert "prefill-0" in served_by, served_by
    c.check_alive()
