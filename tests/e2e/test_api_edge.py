"""Hostile traffic at the OpenAI API, against the whole serving path (`mooncake up`'s cluster:
real processes, the real model): malformed bodies get a specific 4xx, never a 500; oversized
and slow bodies are refused before they cost anything; slowloris connections are closed; a
client that hangs up cancels its request on the decode worker, which frees its KV.

The Conductor runs with short connection deadlines (set through its environment variables) so
the timeouts can be observed in seconds.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_BODY = 4 << 20  # the Conductor's default --max-body-size

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d = tmp_path_factory.mktemp("edge")
    cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=str(d / "logs"),
                   threads=1, ready_timeout_s=300,
                   extra_env={"MOONCAKE_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S),
                              "MOONCAKE_BODY_TIMEOUT": str(BODY_TIMEOUT_S)})
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield c


def _post(cluster: LocalCluster, path: str, data: bytes,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{cluster.base_url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _raw(cluster: LocalCluster, request: bytes, timeout: float = 60.0) -> bytes:
    """Send bytes as they are (no client library would send these) and read the reply."""
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _length(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _status_and_error(reply: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _head(path: str, length: int | None = None, extra: str = "") -> bytes:
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{size}"
            f"{extra}\r\n").encode()


def _conductor_rss_kib(cluster: LocalCluster) -> int:
    pid = cluster.procs["conductor"].popen.pid
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _decode_metric(cluster: LocalCluster, name: str) -> float:
    return metric_value(cluster.procs["decode-0"].metrics(), name)


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_M = MODEL.encode()


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [
    # the three that used to be a 500
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
           b'"seed": 18446744073709551616}' % _M, "seed", "less than or equal to"),
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi\\ud800"}]}' % _M,
     "messages.0.content", "lone UTF-16 surrogate"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, None, "nested deeper than 64"),
    # their relatives
    (COMPLETIONS, b'{"model": "%s", "prompt": ' % _M + b'{"a": ' * 100_000 + b"1" +
     b"}" * 100_001, None, "nested deeper than 64"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "seed": -9223372036854775809}' % _M, "seed",
     "greater than or equal to"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "a\\udfffb"}' % _M, "prompt",
     "lone UTF-16 surrogate"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "stop": ["\\ud800"]}' % _M, "stop.0",
     "lone UTF-16 surrogate"),
    (COMPLETIONS, b'{"model": "\\udc00", "prompt": "x"}', "model", "lone UTF-16 surrogate"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}' % (_M, b"0" * 5000),
     None, "5001 digits"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "max_tokens": 4294967296}' % _M,
     "max_tokens", "less than or equal to 2147483647"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "n": 18446744073709551616}' % _M, "n",
     "less than or equal to"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "top_k": 18446744073709551616}' % _M,
     "top_k", "not supported"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "x", "temperature": NaN}' % _M, None,
     "NaN is not a JSON value"),
    (COMPLETIONS, b'{"model": "%s", "prompt": "\xff\xfe"}' % _M, None, "not valid UTF-8"),
    (COMPLETIONS, b'{"model": "%s", "prompt": [18446744073709551616]}' % _M, "prompt",
     "outside the vocabulary"),
])
def test_malformed_bodies_are_a_specific_400(cluster: LocalCluster, path: str, body: bytes,
                                            param: str | None, fragment: str) -> None:
    status, resp = _post(cluster, path, body)
    assert status == 400, resp
    err = resp["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err


@pytest.mark.parametrize(("request_bytes", "fragment"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n", "Invalid header token"),
    (_head(COMPLETIONS, 5, "Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n",
     "Transfer-Encoding can't be present with Content-Length"),
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
     "Got more than 8190 bytes"),
])
def test_unparseable_http_is_400_in_the_openai_shape(cluster: LocalCluster,
                                                    request_bytes: bytes, fragment: str) -> None:
    status, err = _status_and_error(_raw(cluster, request_bytes))
    assert status == 400 and err["type"] == "invalid_request_error"
    assert err["message"].startswith("malformed HTTP request: ") and fragment in err["message"]


def test_an_oversized_body_is_413_before_it_is_read(cluster: LocalCluster) -> None:
    rss0 = _conductor_rss_kib(cluster)
    big = b'{"model": "%s", "prompt": "' % _M + b"a" * (10 << 20) + b'"}'
    for _ in range(3):
        status, err = _status_and_error(_raw(cluster, _head(COMPLETIONS, len(big)) + big))
        assert status == 413 and err["code"] == "request_too_large"
        assert f"is {len(big)} bytes" in err["message"] and str(MAX_BODY) in err["message"]
    # Without a length (chunked), the read stops at the limit.
    mib = b"a" * (1 << 20)
    chunked = b"".join(b"100000\r\n" + mib + b"\r\n" for _ in range(10)) + b"0\r\n\r\n"
    status, err = _status_and_error(
        _raw(cluster, _head(COMPLETIONS, extra="Transfer-Encoding: chunked\r\n") + chunked))
    assert status == 413 and "larger than that" in err["message"]
    # Neither body was kept: the issue saw ~1.2 GB RSS after one 10 MB body.
    assert _conductor_rss_kib(cluster) - rss0 < 64 << 10


def test_a_body_just_under_the_limit_is_parsed(cluster: LocalCluster) -> None:
    pad = MAX_BODY - 200
    body = b'{"model": "%s", "prompt": "hi", "user": "' % _M + b"u" * pad + b'", "max_tokens": 1}'
    status, resp = _post(cluster, COMPLETIONS, body)
    assert status == 200, resp


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_text_that_cannot_fit_is_refused_before_tokenising(cluster: LocalCluster,
                                                           path: str) -> None:
    text = "lorem ipsum " * 250_000  # 3 MB: under the body limit, far over 8k tokens
    if path == CHAT:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    else:
        body = {"model": MODEL, "prompt": text}
    status, resp = _post(cluster, path, json.dumps(body).encode())
    assert status == 400 and resp["error"]["code"] == "context_length_exceeded", resp
    # "at least": the bound from the text's size, so the tokenizer never ran on it.
    assert "the prompt has at least" in resp["error"]["message"]
    counted = len(text.strip()) if path == CHAT else len(text)  # chat templates may trim
    assert f"({counted} bytes of text)" in resp["error"]["message"]


def test_compressed_and_slow_bodies_are_refused(cluster: LocalCluster) -> None:
    status, err = _status_and_error(
        _raw(cluster, _head(COMPLETIONS, 10, "Content-Encoding: gzip\r\n") + b"\x1f\x8b" * 5))
    assert status == 415 and "gzip" in err["message"]
    status, err = _status_and_error(_raw(cluster, _head(COMPLETIONS, 100) + b'{"model"'))
    assert status == 408 and f"within {BODY_TIMEOUT_S:g} s" in err["message"]


def test_slowloris_is_closed_within_the_header_timeout(cluster: LocalCluster) -> None:
    before = metric_value(cluster.procs["conductor"].metrics(),
                          "mooncake_conductor_header_timeouts_total")
    s = socket.create_connection(("127.0.0.1", cluster.port))
    s.settimeout(0.1)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
    t0 = time.monotonic()
    closed_after = None
    served = 0
    while time.monotonic() - t0 < HEADER_TIMEOUT_S * 10:
        try:
            s.sendall(b"X-Pad-%d: y\r\n" % served)
            if s.recv(100) == b"":
                closed_after = time.monotonic() - t0
                break
        except TimeoutError:
            pass
        except ConnectionError:
            closed_after = time.monotonic() - t0
            break
        # Meanwhile the Conductor serves everyone else.
        with urllib.request.urlopen(f"{cluster.base_url}/healthz", timeout=10) as r:
            assert r.status == 200
        served += 1
    s.close()
    assert closed_after is not None, "a connection dribbling its headers was never closed"
    assert closed_after >= HEADER_TIMEOUT_S * 0.9 and served >= 3
    after = metric_value(cluster.procs["conductor"].metrics(),
                         "mooncake_conductor_header_timeouts_total")
    assert after == before + 1


def _stream_and_hang_up(cluster: LocalCluster, prompt: str, events: int,
                        stream: bool = True) -> int:
    """Start a long generation, read `events` SSE events (or wait for one decode token when
    not streaming), hang up; the number of tokens this client saw from decode."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2000,
                       "ignore_eos": True, "stream": stream}).encode()
    tokens0 = _decode_metric(cluster, "mooncake_decode_tokens_total")
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=120)
    s.sendall(_head(COMPLETIONS, len(body)) + body)
    got = b""
    if stream:
        while got.count(b"data:") < events:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    else:
        _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_tokens_total") > tokens0,
                  "decode started")
    s.close()
    return max(got.count(b"data:") - 1, 0)  # the first event's token comes from prefill


def _idle_decode(cluster: LocalCluster, cancelled_before: float, hang_ups: int) -> None:
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_cancelled_total")
              >= cancelled_before + hang_ups, "decode saw the cancellations")
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_running") == 0,
              "decode batch empty")


def test_a_hang_up_mid_stream_stops_decode_and_frees_its_kv(cluster: LocalCluster) -> None:
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_running") == 0, "idle decode")
    kv_free = _decode_metric(cluster, "mooncake_decode_kv_free_tokens")
    cancelled = _decode_metric(cluster, "mooncake_decode_cancelled_total")
    tokens0 = _decode_metric(cluster, "mooncake_decode_tokens_total")
    seen = _stream_and_hang_up(cluster, "Tell me a very long story about a lighthouse", 6)
    _idle_decode(cluster, cancelled, 1)
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_kv_free_tokens") == kv_free,
              "the request's KV freed")
    generated = _decode_metric(cluster, "mooncake_decode_tokens_total") - tokens0
    # max_tokens was 2000; decode stopped where the client left (gRPC flow control and the
    # socket buffers may hold a few tokens the client never read).
    assert seen >= 5 and generated <= seen + 8, (seen, generated)
    time.sleep(1.0)
    assert _decode_metric(cluster, "mooncake_decode_tokens_total") - tokens0 == generated


def test_many_hang_ups_waste_almost_nothing(cluster: LocalCluster) -> None:
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_running") == 0, "idle decode")
    cancelled = _decode_metric(cluster, "mooncake_decode_cancelled_total")
    tokens0 = _decode_metric(cluster, "mooncake_decode_tokens_total")
    hang_ups = 10
    seen = sum(_stream_and_hang_up(cluster, f"Story number {i}: once upon a time", 3)
               for i in range(hang_ups))
    _idle_decode(cluster, cancelled, hang_ups)
    wasted = _decode_metric(cluster, "mooncake_decode_tokens_total") - tokens0 - seen
    # The issue measured ~940 tokens generated for nobody after 25 hang-ups.
    assert wasted <= 2 * hang_ups, (seen, wasted)


def test_a_hang_up_on_a_non_streamed_request_cancels_it(cluster: LocalCluster) -> None:
    _wait_for(lambda: _decode_metric(cluster, "mooncake_decode_running") == 0, "idle decode")
    cancelled = _decode_metric(cluster, "mooncake_decode_cancelled_total")
    tokens0 = _decode_metric(cluster, "mooncake_decode_tokens_total")
    _stream_and_hang_up(cluster, "Write a long essay about rivers", 0, stream=False)
    _idle_decode(cluster, cancelled, 1)
    assert _decode_metric(cluster, "mooncake_decode_tokens_total") - tokens0 < 200


def test_hang_ups_during_prefill_never_reach_decode(cluster: LocalCluster) -> None:
    """Two long prompts, both abandoned while prefill works on the first: the second is
    skipped where it waits (prefill cannot stop a forward pass midway, but it need not start
    one for nobody), and decode never sees either."""
    conductor, prefill = cluster.procs["conductor"], cluster.procs["prefill-0"]
    closed = metric_value(conductor.metrics(), "mooncake_conductor_requests_total",
                          'status="client_closed"')
    skipped = metric_value(prefill.metrics(), "mooncake_prefill_requests_total",
                           'result="cancelled"')
    decode_requests = _decode_metric(cluster, "mooncake_decode_requests_total")
    tokens0 = _decode_metric(cluster, "mooncake_decode_tokens_total")
    sockets = []
    for n in range(2):  # uncached prompts: ~10 s of prefill per 1000 tokens on the dev VM
        prompt = [1000 + (i * 7919 + n) % 40_000 for i in range(1500)]
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 500,
                           "ignore_eos": True, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", cluster.port), timeout=120)
        s.sendall(_head(COMPLETIONS, len(body)) + body)
        sockets.append(s)
    time.sleep(1.0)
    for s in sockets:
        s.settimeout(0.01)
        with pytest.raises(TimeoutError):
            s.recv(1)  # nothing yet: the client leaves before its first token
        s.close()
    _wait_for(lambda: metric_value(conductor.metrics(), "mooncake_conductor_requests_total",
                                   'status="client_closed"') == closed + 2,
              "the Conductor saw both hang-ups")
    _wait_for(lambda: metric_value(prefill.metrics(), "mooncake_prefill_queued_tokens") == 0,
              "prefill finished with both", timeout=180)
    assert metric_value(prefill.metrics(), "mooncake_prefill_requests_total",
                        'result="cancelled"') == skipped + 1
    time.sleep(1.0)
    assert _decode_metric(cluster, "mooncake_decode_requests_total") == decode_requests
    assert _decode_metric(cluster, "mooncake_decode_tokens_total") == tokens0


def test_hang_ups_are_an_info_line_and_nothing_was_a_500(cluster: LocalCluster) -> None:
    """Runs after the others in this module: their traffic is in the logs."""
    log = cluster.procs["conductor"].log()
    assert "INFO request cancelled: the client closed the connection" in log
    assert "INFO closing a connection that sent no complete request head in time" in log
    assert "INFO malformed HTTP request" in log
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]
    decode_log = cluster.procs["decode-0"].log()
    assert "Traceback" not in decode_log, decode_log[-4000:]
    metrics = cluster.procs["conductor"].metrics()
    assert metric_value(metrics, "mooncake_conductor_requests_total", 'status="500"') == 0
    assert metric_value(metrics, "mooncake_conductor_requests_total",
                        'status="client_closed"') >= 14
