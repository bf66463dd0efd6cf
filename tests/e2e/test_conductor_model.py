"""The Conductor serves the cluster's model (issue 18), and drains on SIGTERM: real processes.

One cluster as `mooncake up --model DIR` runs it (`LocalCluster`: master, store node, prefill,
decode and Conductor) serves a tiny model that is not SmolLM2 (random Llama weights
and a tokenizer trained in the test). Its Conductor must tokenise as the workers do: a prompt
sent as text is reported with the token count of the workers' tokenizer, and reuses every full
KV block that the same prompt sent as the workers' own token ids wrote (block keys are hashes of
token ids: other ids, other keys, no reuse). A second Conductor given no model (so the built-in
SmolLM2 tokenizer) is started against the same workers: it is not ready, says why, and refuses
requests. A third, with the right model, is stopped with SIGTERM mid-stream: readiness turns
503 at once, new connections are refused, the stream still ends with every token, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.common.netutil import free_service_port
from mooncake_k8s.up import LocalCluster, UpConfig

pytestmark = pytest.mark.timeout(600)
HOST = "127.0.0.1"
BT = 64  # --block-tokens of the cluster (the default)
NAME = "tiny-llama"


# -- a tiny model that is not SmolLM2 (random Llama weights, a tokenizer trained here) ----
_WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
          "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie", "quartz", "river",
          "savanna", "tundra", "umber", "valley", "willow", "xenon", "yonder", "zephyr", "the",
          "a", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at",
          "from")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")


def corpus(n: int = 400) -> list[str]:
    """Sentences over a fixed vocabulary (deterministic): training text and prompts."""
    return [" ".join(_WORDS[(i * 7 + j * 3 + i // 5) % len(_WORDS)] for j in range(12))
            for i in range(n)]


def make_tiny_model(path: Path, max_context: int = 8192) -> Path:
    """Write config, random weights (seeded) and the trained tokenizer into `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True)
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_context, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"))
    torch.manual_seed(18)
    LlamaForCausalLM(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / NAME)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalCluster]:
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, threads=1,
                   model=str(model_dir), log_dir=str(tmp_path_factory.mktemp("up")),
                   ready_timeout_s=300)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


def _tokenizer(model_dir: Path | None) -> Any:
    """A tokenizer loaded as the embedded engine loads its model's (AutoTokenizer on the
    directory; None: the built-in model's)."""
    from transformers import AutoTokenizer

    from mooncake_k8s.engine.loading import ensure_builtin

    return AutoTokenizer.from_pretrained(str(model_dir or ensure_builtin(progress=False)[0]))


def _request(base: str, path: str, body: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data=data, method="GET" if body is None
                                 else "POST", headers={"Content-Type": "application/json",
                                                       **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _prompt() -> str:
    return " ".join(corpus(40)[5:30])


# -- the cluster's own Conductor tokenises as the workers do ---------------------------------


def test_models_lists_the_tiny_model(cluster: LocalCluster) -> None:
    status, body, _ = _request(cluster.base_url, "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == [NAME]


def test_text_prompt_gets_the_workers_token_ids(cluster: LocalCluster, model_dir: Path) -> None:
    text = _prompt()
    ids = _tokenizer(model_dir).encode(text)
    assert ids != _tokenizer(None).encode(text), "the test model must not tokenise as SmolLM2"
    assert len(ids) > 3 * BT
    sampling = {"model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, raw, _ = _request(cluster.base_url, "/v1/completions", {**sampling, "prompt": ids})
    assert status == 200, raw
    by_ids = json.loads(raw)
    status, raw, _ = _request(cluster.base_url, "/v1/completions", {**sampling, "prompt": text})
    assert status == 200, raw
    by_text = json.loads(raw)
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    # Same ids, same block keys: the text request reuses every full block the ids one wrote.
    cached = by_text["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(ids) - 1) // BT * BT
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]


def test_chat_uses_the_models_chat_template(cluster: LocalCluster, model_dir: Path) -> None:
    messages = [{"role": "user", "content": corpus(3)[2]}]
    want = _tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    status, raw, _ = _request(cluster.base_url, "/v1/chat/completions",
                              {"model": NAME, "messages": messages, "max_tokens": 2})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(want)


# -- Conductors of our own against the cluster's workers --------------------------------------


@dataclass
class Conductor:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def ops(self) -> str:
        return f"http://{HOST}:{self.metrics_port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def _conductor(cluster: LocalCluster, log: Path, *extra: str) -> Iterator[Conductor]:
    port, mport = free_service_port(HOST), free_service_port(HOST)
    args = [sys.executable, "-m", "mooncake_k8s.cli", "conductor", "--host", HOST,
            "--port", str(port), "--metrics-port", str(mport), "--master", cluster.master,
            "--prefill", ",".join(f"{HOST}:{p}" for p in cluster.prefill_ports),
            "--decode", ",".join(f"{HOST}:{p}" for p in cluster.decode_ports), *extra]
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": cluster.token, "PYTHONUNBUFFERED": "1",
           "MOONCAKE_LOG_FORMAT": "text"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    c = Conductor(proc, port, mport, log)
    try:
        yield c
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _readyz(c: Conductor, deadline_s: float, status: int, says: str) -> str:
    """Poll the metrics port's /readyz until it answers `status` with `says` in its body."""
    end = time.monotonic() + deadline_s
    last = (0, "")
    while time.monotonic() < end:
        assert c.proc.poll() is None, c.log_text()
        with contextlib.suppress(OSError):
            got, body, _ = _request(c.ops, "/readyz")
            last = (got, body.decode())
            if got == status and says in last[1]:
                return last[1]
        time.sleep(0.1)
    raise AssertionError(f"/readyz never said {status} {says!r}; last {last}\n{c.log_text()}")


def test_conductor_with_another_tokenizer_is_not_ready_and_says_why(
        cluster: LocalCluster, tmp_path: Path) -> None:
    with _conductor(cluster, tmp_path / "wrong.log") as c:  # no --model: SmolLM2's tokenizer
        body = _readyz(c, 120, 503, "tokenizer mismatch")
        assert "prefill instance prefill-0" in body and NAME in body, body
        status, raw, _ = _request(c.ops, "/readyz", headers={"Accept": "application/json"})
        doc = json.loads(raw)
        assert status == 503 and doc["ready"] is False
        cond = {x["type"]: x for x in doc["conditions"]}["TokenizerMatchesWorkers"]
        assert cond["status"] == "False" and cond["reason"] == "TokenizerMismatch"
        # Requests are refused, never answered with the wrong model's token ids.
        status, raw, _ = _request(c.base, "/v1/completions",
                                  {"model": NAME, "prompt": "amber dune", "max_tokens": 2})
        assert status == 503, raw
        assert "tokenizer mismatch" in json.loads(raw)["error"]["message"]
        # /metrics is on the metrics port only.
        assert _request(c.ops, "/metrics")[0] == 200
        assert _request(c.base, "/metrics")[0] == 404
        _operator_reports_it(c, cond["message"])


def _operator_reports_it(c: Conductor, message: str) -> None:
    """The operator reads the unready Conductor pod's /readyz (as it would the pod's, at its
    IP and `metrics` port) and reports the mismatch in the cluster's Degraded condition."""
    import aiohttp

    from mooncake_k8s.operator import naming
    from mooncake_k8s.operator.reconcile import conductor_reasons
    from mooncake_k8s.operator.render import render
    from mooncake_k8s.operator.status import Observed, aggregate
    from mooncake_k8s.operator.validation import validate_cluster

    pod = {"metadata": {"name": "demo-conductor-0", "labels": {
               naming.LABEL_COMPONENT: "conductor"}},
           "spec": {"containers": [{"name": "conductor", "ports": [
               {"name": "metrics", "containerPort": c.metrics_port}]}]},
           "status": {"podIP": HOST, "conditions": [{"type": "Ready", "status": "False"}]}}

    async def reasons() -> list[str]:
        async with aiohttp.ClientSession() as http:
            return await conductor_reasons(http, [pod])

    got = asyncio.run(reasons())
    assert got == [f"demo-conductor-0: {message[:400]}"]
    cluster = validate_cluster({"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
                                "metadata": {"name": "demo", "namespace": "ml"}, "spec": {}})
    st = aggregate(cluster, render(cluster), Observed({}, [pod], conductor=got),
                   "2026-01-01T00:00:00Z")
    degraded = {x["type"]: x for x in st["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "TokenizerMismatch"
    assert "demo-conductor-0: tokenizer mismatch" in degraded["message"]


def _long_stream(stack: contextlib.ExitStack, c: Conductor, n: int
                 ) -> tuple[http.client.HTTPResponse, bytes]:
    """A streamed completion of `n` tokens (seconds long), its first event already read."""
    conn = http.client.HTTPConnection(HOST, c.port, timeout=300)
    stack.callback(conn.close)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": NAME, "prompt": "amber dune", "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    return resp, first


def _rest(resp: http.client.HTTPResponse, first: bytes) -> tuple[list[Any], bool]:
    """Every event of the stream and whether it ended with [DONE] (not cut)."""
    events, done = [json.loads(first[6:])], False
    with contextlib.suppress(http.client.IncompleteRead, ConnectionError):
        for line in resp:
            if line.strip() == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events, done


def test_sigterm_drains_a_stream_then_exits_zero(cluster: LocalCluster, model_dir: Path,
                                                 tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(_conductor(cluster, tmp_path / "drain.log", "--model",
                                           str(model_dir), "--shutdown-timeout", "300"))
        _readyz(c, 120, 200, "ready")
        n = 4000  # long enough that it is still streaming while the checks below run
        resp, first = _long_stream(stack, c, n)
        c.proc.send_signal(signal.SIGTERM)
        _readyz(c, 60, 503, "shutting down")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((HOST, c.port), timeout=5).close()
        events, done = _rest(resp, first)
        assert done, "the stream must end with [DONE], not be cut"
        assert events[-1]["usage"]["completion_tokens"] == n
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert c.proc.wait(timeout=120) == 0, c.log_text()
        assert "conductor draining" in c.log_text()


def test_second_sigterm_ends_the_drain_at_once(cluster: LocalCluster, model_dir: Path,
                                               tmp_path: Path) -> None:
    """The drain's deadline, reached early: what still streams is cut, the exit is clean."""
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(_conductor(cluster, tmp_path / "hurry.log", "--model",
                                           str(model_dir), "--shutdown-timeout", "300"))
        _readyz(c, 120, 200, "ready")
        resp, first = _long_stream(stack, c, 4000)
        c.proc.send_signal(signal.SIGTERM)
        _readyz(c, 60, 503, "shutting down")
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(timeout=60) == 0, c.log_text()
        events, done = _rest(resp, first)
        assert not done and len(events) < 4000
        assert "stopping with requests still in flight" in c.log_text()
