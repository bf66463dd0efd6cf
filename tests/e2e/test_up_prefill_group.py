"""`mooncake up --prefill 2 --prefill-group-size 2` (issue 21): the local cluster's two prefill
instances form one pipeline group, real processes and the real model on loopback.

The Conductor lists both (the leader `prefill-0` as a whole group of 2, `prefill-1` as a later
stage that is never a target); a chat request is prefilled by the group (the answer names the
leader and two stages) and the second stage's own metrics show it computed. Equal token ids
against a single instance are tests/e2e/test_pipeline.py's (on the multi-host bed). No timing
assertion: a hang fails through the client's and the test's timeouts.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.timeout(600)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _prefill_instances(c: LocalCluster) -> dict[str, dict[str, Any]]:
    listing = json.loads(_get(f"{c.base_url}/v1/instances"))
    return {i["instance_id"]: i for i in listing["prefill"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("up-groups")
    cfg = UpConfig(port=0, prefill=2, prefill_group_size=2, decode=1, store_size=256 << 20,
                   log_dir=str(d / "logs"), threads=1, ready_timeout_s=300)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        deadline = time.monotonic() + 120
        while _prefill_instances(c).get("prefill-0", {}).get("state") != "ready":
            assert time.monotonic() < deadline, _prefill_instances(c)
            c.check_alive()
            time.sleep(0.3)
        yield c


def test_the_conductor_sees_one_group_of_two(cluster: LocalCluster) -> None:
    seen = _prefill_instances(cluster)
    assert seen["prefill-0"]["group"] == {"name": "g0", "stage": 0, "size": 2, "whole": True,
                                          "broken": ""}, seen
    assert seen["prefill-1"]["state"] == "stage", seen
    assert seen["prefill-1"]["group"]["stage"] == 1, seen


def test_a_request_is_prefilled_by_the_whole_group(cluster: LocalCluster) -> None:
    stage_1 = f"http://127.0.0.1:{cluster.procs['prefill-1'].metrics_port}/metrics"
    before = metric_value(_get(stage_1), "mooncake_prefill_stage_busy_seconds_total")
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours of the sea."}]}
    req = urllib.request.Request(f"{cluster.base_url}/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.loads(r.read())
        assert r.headers["X-Mooncake-Prefill"] == "prefill-0"
        assert r.headers["X-Mooncake-Prefill-Stages"] == "2"
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1
    after = metric_value(_get(stage_1), "mooncake_prefill_stage_busy_seconds_total")
    assert after > before  # stage 1 computed its layers for this prompt
