"""Chunked pipeline-parallel prefill (issue 21) on the multi-host test bed, real processes: one
prefill group of two stages (`g0-s0`, the leader, and `g0-s1`, each its own emulated host with
its own address, IPC namespace and 1 Gbit/s link), one single prefill instance (`prefill-0`),
one decode and the Conductor, all serving the real model. One cluster serves every test, in
order:

1. the group's stages run on separate hosts and the Conductor lists the leader as a group of 2
   (the later stage listed, never a target);
2. greedy token ids straight from the group (gRPC `Prefill`, one call per token) equal a single
   instance's, for a short and a long (~1K-token) prompt, both computed cold (another tenant
   each), the group's answer carrying both stages' stats;
3. a prefix the group computed is reused by the single instance, and the reverse: the repeat
   reports cached tokens and answers the same text (the KV a group stores is the KV a single
   instance stores, read whole by anyone);
4. a stage killed (SIGKILL) mid-prompt: the request is still answered, by the single instance
   (the Conductor's retry: `reroutes_total{cause="group_unavailable"}`), within the client's
   bound; the group is out of rotation (`incomplete`; a request asking for a group of 2 gets
   503) until the stage is back, then serves again with the same answer.

Needs root and network namespaces (CI has them); without them the bed raises
`TestbedUnavailable` and this fails: it never skips. No timing assertion: a hang fails through
the client's timeout and the test's own.
"""

from __future__ import annotations

import json
import signal
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
from mooncake_k8s.testbed.greedy import Job, greedy_ids

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
CLIENT_TIMEOUT_S = 120
"""Bounds every request: a failover that waited out more than the stage timeout fails here."""
STAGE_TIMEOUT_S = 3.0
GROUP_HEADER = "X-Mooncake-Prefill-Group-Size"
REROUTED = 'cause="group_unavailable",role="prefill"'


def text(tag: str, words: int) -> str:
    """A prompt starting with words of its own (`tag`): two tags share no KV block."""
    return f"{tag} {tag}. Repeat the last word: " + " ".join(
        WORDS[(i * 7 + i // 5 + len(tag)) % 16] for i in range(words))


SHORT = "Name three colours of the sea."
LONG = text("long", 800)  # about 1K tokens with the chat template


def _chat(base_url: str, content: str, group: int | None = None,
          max_tokens: int = 8) -> dict[str, Any]:
    """The greedy reply's text and route headers (`group`: the prefill target's stage count)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if group is not None:
        headers[GROUP_HEADER] = str(group)
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(), headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=CLIENT_TIMEOUT_S) as r:
            reply = json.loads(r.read())
            return {"text": reply["choices"][0]["message"]["content"],
                    "prompt_tokens": reply["usage"]["prompt_tokens"],
                    "prefill": r.headers["X-Mooncake-Prefill"],
                    "stages": int(r.headers.get("X-Mooncake-Prefill-Stages", "0") or 0),
                    "cached": int(r.headers.get("X-Mooncake-Cached-Tokens", "0") or 0)}
    except urllib.error.HTTPError as e:  # the answer's body says why
        return {"status": e.code, "error": e.read()[:1000].decode(errors="replace")}


def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return str(r.read().decode())


def _instances(c: BedCluster) -> dict[str, dict[str, Any]]:
    """The Conductor's prefill instances by id (`GET /v1/instances`)."""
    listing = json.loads(c.client_call(_get, f"{c.base_url}/v1/instances"))
    return {i["instance_id"]: i for i in listing["prefill"]}


def _until_state(c: BedCluster, instance: str, state: str) -> None:
    """Wait for the Conductor to see `instance` in `state` (the deadline bounds a broken run)."""
    deadline = time.monotonic() + 120
    while (seen := _instances(c).get(instance, {}).get("state")) != state:
        assert time.monotonic() < deadline, f"{instance} stayed {seen!r}, never {state!r}"
        c.check_alive()
        time.sleep(0.3)


def _stage_metric(c: BedCluster, name: str, metric: str, labels: str = "") -> float:
    return metric_value(c.hosts[name].call(_get, c.metrics_url(name)), metric, labels)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BedCluster]:
    d = tmp_path_factory.mktemp("bed")
    cfg = BedConfig(prefill=1, decode=1, prefill_groups=[2], rate="1gbit",
                    pipeline_stage_timeout_s=STAGE_TIMEOUT_S, log_dir=str(d),
                    ready_timeout_s=240)
    with Testbed() as bed, BedCluster(bed, cfg, echo=lambda _m: None) as c:
        for target in c.prefill_targets:  # the Conductor's view lags its workers' by a poll
            _until_state(c, target, "ready")
        yield c


def test_stages_on_separate_hosts_and_one_target(cluster: BedCluster) -> None:
    c = cluster
    assert c.hosts["g0-s0"].addr != c.hosts["g0-s1"].addr
    ipc = {Path(f"/proc/{c.procs[n].pid}/ns/ipc").readlink() for n in ("g0-s0", "g0-s1")}
    assert len(ipc) == 2  # the transfer engine sees the next stage as a remote peer
    seen = _instances(c)
    assert seen["g0-s0"]["state"] == "ready", seen
    assert seen["g0-s0"]["group"]["size"] == 2 and seen["g0-s0"]["group"]["whole"], seen
    assert seen["g0-s1"]["state"] == "stage", seen
    assert seen["prefill-0"]["state"] == "ready", seen


def test_group_gives_the_single_instance_token_ids(cluster: BedCluster) -> None:
    c = cluster
    # Each prompt from the group and from the single instance, each under a tenant of its
    # own (so both compute it cold), four greedy tokens each; one client process for all.
    jobs = [Job(c.addr(target), prompt, 4, f"{target}-{name}")
            for name, prompt in (("short", SHORT), ("long", LONG))
            for target in ("g0-s0", "prefill-0")]
    got = greedy_ids(c.hosts["conductor"], jobs, c.env(), c.log_dir / "greedy.log",
                     timeout_s=CLIENT_TIMEOUT_S)
    for name, (group, single) in zip(("short", "long"), (got[:2], got[2:]), strict=True):
        assert group["ids"] == single["ids"], name
        assert group["cached"][0] == single["cached"][0] == 0, name  # both computed it all
        assert [s["stage"] for s in group["stages"][0]] == [0, 1], name  # by both stages
        assert group["stages"][0][1]["bytes_in"] > 0, name
        assert single["stages"][0] == [], name
    long_group = got[2]
    assert len(long_group["prompt_ids"]) > 900
    assert long_group["cached"][1] > 0  # the next call reused the group's own blocks


def test_a_prefix_cached_by_either_is_reused_by_the_other(cluster: BedCluster) -> None:
    c = cluster
    for first, then, tag in ((2, 1, "bygroup"), (1, 2, "bysingle")):
        prompt = text(tag, 800)
        cold = c.client_call(_chat, c.base_url, prompt, first)
        assert "error" not in cold, cold
        assert cold["cached"] == 0 and cold["stages"] == first, cold
        repeat = c.client_call(_chat, c.base_url, prompt, then)
        assert "error" not in repeat, repeat
        assert repeat["stages"] == then, repeat
        assert repeat["prefill"] == ("prefill-0" if then == 1 else "g0-s0"), repeat
        # The prompt's full blocks (but for the last, at most) came from the other's copy.
        assert repeat["cached"] >= cold["prompt_tokens"] - 128, (cold, repeat)
        assert repeat["text"] == cold["text"], (tag, cold, repeat)


def _kill_when_stage1_works(c: BedCluster, before: float, done: Any) -> bool:
    """SIGKILL stage 1 once hidden states of the running prompt reached it; False when the
    request ended first (it was not computed by the group)."""
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while not done.done():
        got = _stage_metric(c, "g0-s1", "mooncake_prefill_stage_bytes_total", 'direction="in"')
        if got > before:
            c.kill("g0-s1", signal.SIGKILL)
            return True
        assert time.monotonic() < deadline, "the prompt never reached stage 1"
        time.sleep(0.05)
    return False


@pytest.mark.timeout(900)
def test_a_stage_killed_mid_prompt_fails_over_and_the_group_leaves_rotation(
        cluster: BedCluster) -> None:
    c = cluster
    prompt = text("killed", 1300)  # about 1.5K tokens: the group computes it for seconds
    metrics0 = c.client_call(_get, f"{c.base_url}/metrics")
    rerouted0 = metric_value(metrics0, "mooncake_conductor_reroutes_total", REROUTED)
    failed0 = metric_value(metrics0, "mooncake_conductor_requests_total", 'status="5')
    in0 = _stage_metric(c, "g0-s1", "mooncake_prefill_stage_bytes_total", 'direction="in"')
    with ThreadPoolExecutor(1) as pool:
        # No group header: the Conductor picks the group (a long cold prompt is faster there)
        # and must move the request when the group fails it.
        fut = pool.submit(c.client_call, _chat, c.base_url, prompt)
        killed = _kill_when_stage1_works(c, in0, fut)
        reply = fut.result(timeout=CLIENT_TIMEOUT_S + 10)
    assert killed, f"the request was answered before stage 1 got any of it: {reply}"
    assert "error" not in reply, reply
    assert reply["prefill"] == "prefill-0" and reply["stages"] == 1, reply
    text1 = c.client_call(_get, f"{c.base_url}/metrics")
    assert metric_value(text1, "mooncake_conductor_reroutes_total", REROUTED) > rerouted0, text1
    assert metric_value(text1, "mooncake_conductor_requests_total", 'status="5') == failed0
    leader = c.hosts["g0-s0"].call(_get, c.metrics_url("g0-s0"))
    assert metric_value(leader, "mooncake_prefill_stage_failures_total") > 0, leader

    # Out of rotation while a stage is missing: asking for a group of 2 finds none.
    _until_state(c, "g0-s0", "incomplete")
    refused = c.client_call(_chat, c.base_url, SHORT, 2)
    assert refused.get("status") == 503, refused
    assert c.client_call(_chat, c.base_url, SHORT)["prefill"] == "prefill-0"

    c.respawn(["g0-s1"])
    _until_state(c, "g0-s0", "ready")
    again = c.client_call(_chat, c.base_url, prompt, 2)
    assert "error" not in again, again
    assert again["prefill"] == "g0-s0" and again["text"] == reply["text"], (again, reply)
    c.check_alive()
