"""The cluster with every component on its own emulated host (`mooncake_k8s.testbed`): master,
store node, 2 prefill, 2 decode and the Conductor, each with its own address, IPC namespace and a
1 Gbit/s link, serving the real model. Greedy text equals a one-host run's (`mooncake up` on
127.0.0.1), and the hosts' byte counters show the KV leaving a prefill host for a decode host,
not passing the Conductor or the master.

Needs root and network namespaces (CI has them); without them the bed raises
`TestbedUnavailable` and this fails: it never skips.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig
from mooncake_k8s.up import LocalCluster, UpConfig

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
MB = 1 << 20
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
#: 419 tokens with the chat template: six full KV blocks of 64, 19 MB of KV (fp32 on CPU).
PROMPT = "Repeat the last word: " + " ".join(WORDS[(i * 7 + i // 5) % 16] for i in range(320))


def _chat(base_url: str, content: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(f"{base_url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def one_host_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same prompt through `mooncake up`'s cluster on loopback (1 prefill, 1 decode)."""
    d = tmp_path_factory.mktemp("one-host")
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=str(d),
                   threads=1, ready_timeout_s=240)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        return str(_chat(c.base_url, PROMPT)["choices"][0]["message"]["content"])


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
        cluster: BedCluster, one_host_text: str) -> None:
    bed = cluster.bed
    before = bed.counters()
    reply = cluster.client_call(_chat, cluster.base_url, PROMPT)
    after = bed.counters()
    text = reply["choices"][0]["message"]["content"]
    assert text == one_host_text
    assert reply["usage"]["prompt_tokens"] >= 320
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    prefill_sent = max(moved[n][0] for n in moved if n.startswith("prefill"))
    decode_received = max(moved[n][1] for n in moved if n.startswith("decode"))
    # 19 MB of KV a copy (measured: 38.7 MB left prefill-0, two replicas; 19.3 MB reached the
    # decode host and the store each): it leaves one prefill host and reaches a decode host.
    assert prefill_sent > 8 * MB, moved
    assert decode_received > 4 * MB, moved
    # The KV never passes through the Conductor (the client is on its host) or the master.
    for host in ("conductor", "master"):
        assert sum(moved[host]) < MB, moved
