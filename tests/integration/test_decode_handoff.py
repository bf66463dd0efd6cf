"""Drain with live KV handoff (issue 23), decode and prefill sides, all real processes on
loopback: a store master and node, `mooncake prefill`, and two `mooncake decode` instances
(each serving its own DRAM segment), talking gRPC directly (no Conductor).

A decode told to stop (SIGTERM) with streams far from done hands them over: each stream's
last message is a `DecodeHandoff`, the context's KV is in the pool off the stopping instance
(its prompt blocks lived only on that instance's own segment, so they are written again
elsewhere), and a plain DecodeRequest on the other decode, as the Conductor sends it, continues
the stream: every token equals an undisturbed run's, none twice, with no prefill call and zero
tokens recomputed. The stopping decode runs one sequence at a time (--max-batch 1), so of its
two streams one is mid-stream (greedy) and the other still waits for room (seeded: only the
prefill's token streamed); both are handed over. A prefill told to stop ends the prompts it
could not finish within the grace with UNAVAILABLE (which the Conductor retries elsewhere) and
exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import EngineInfo
from mooncake_k8s.store.testing import StoreCluster, metric_value
from mooncake_k8s.testbed.cluster import http_ok

pytestmark = pytest.mark.timeout(600)
TOKEN = "handoff-test-token"
MAX_TOKENS = 400
"""Far more than fit in the decode's grace at any plausible step time: handed over at once."""
COMPARED = 100
"""Tokens compared with the undisturbed run (sampling draws by position, so a run cut at
COMPARED tokens is the first COMPARED of one going on to MAX_TOKENS)."""
READ_BEFORE_STOP = 6
PROMPT = [1, *((i * 7919) % 40000 + 100 for i in range(149))]  # 2 full blocks and a tail
SAMPLINGS = {"greedy": pb.Sampling(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
             "seeded": pb.Sampling(temperature=0.9, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   has_seed=True, seed=23)}


@dataclass
class Bed:
    store: StoreCluster
    workdir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def start(self, role: str, name: str, *extra: str) -> None:
        self.ports[name], mport = free_port(), free_port()
        args = [role, "--master", self.store.master_address, "--port", str(self.ports[name]),
                "--metrics-port", str(mport), "--instance-id", name, "--threads", "1",
                "--log-format", "text", *extra]
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen([sys.executable, "-m", "mooncake_k8s.cli", *args],
                                     stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.procs[name] = Proc(name, args, popen, log_path, mport)

    def wait_ready(self, *names: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            p = self.procs[name]
            while not http_ok(f"http://127.0.0.1:{p.metrics_port}/readyz"):
                assert p.alive(), p.log()[-3000:]
                assert time.monotonic() < deadline, f"{name} not ready"
                time.sleep(0.2)

    def channel(self, name: str) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.ports[name]}")

    def load(self, name: str) -> pb.LoadReport:
        with self.channel(name) as ch:
            rep: pb.LoadReport = serving_rpc.stub(self.procs[name].args[0], ch).Load(
                pb.LoadRequest(), metadata=call_metadata(TOKEN), timeout=10)
        return rep

    def info(self) -> EngineInfo:
        r = self.load("d2")
        return EngineInfo(r.engine, r.model, r.model_fingerprint, r.dtype, r.block_tokens,
                          r.max_context, kv_layout=r.kv_layout)

    def plan(self, tokens: list[int], tenant: str, write_segment: str = "") -> pb.KVPlan:
        """The plan the Conductor sends: the full-block keys in the tenant's namespace."""
        info = self.info()
        return pb.KVPlan(block_keys=info.block_keys(tokens, tenant), planned=True,
                         namespace=info.namespace(tenant).digest().hex(),
                         write_segment=write_segment)

    def prefill(self, rid: str, tokens: list[int], sampling: pb.Sampling, plan: pb.KVPlan,
                tenant: str) -> pb.PrefillResponse:
        with self.channel("p") as ch:
            resp: pb.PrefillResponse = serving_rpc.stub("prefill", ch).Prefill(
                pb.PrefillRequest(request_id=rid, token_ids=tokens, sampling=sampling,
                                  use_prefix_cache=True, plan=plan, tenant=tenant),
                metadata=call_metadata(TOKEN), timeout=300)
        return resp


class Stream:
    """One Decode call read on its own thread: every message, and a signal after the first
    `READ_BEFORE_STOP` tokens."""

    def __init__(self, bed: Bed, name: str, req: pb.DecodeRequest, limit: int = 0) -> None:
        self.limit = limit
        """Stop reading (cancel the call) after this many messages (0 = read to the end)."""
        self.chunks: list[pb.DecodeChunk] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()
        self._ch = bed.channel(name)
        self._call = serving_rpc.stub("decode", self._ch).Decode(
            req, metadata=call_metadata(TOKEN), timeout=300)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for chunk in self._call:
                self.chunks.append(chunk)
                if len(self.chunks) >= READ_BEFORE_STOP:
                    self.started.set()
                if len(self.chunks) == self.limit:
                    self._call.cancel()
                    break
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()
            self._ch.close()

    def join(self) -> list[pb.DecodeChunk]:
        self._thread.join(300)
        assert self.error is None, f"{self.error.code()}: {self.error.details()}"
        return self.chunks

    def tokens(self) -> list[int]:
        return [c.token_id for c in self.join() if not c.HasField("handoff")]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with StoreCluster(token=TOKEN) as store:
        store.start_master()
        store.start_node("n0", "256MiB")
        b = Bed(store, tmp_path_factory.mktemp("handoff"))
        try:
            b.start("prefill", "p", "--local-segment-size", "0", "--drain-timeout", "1")
            for name, batch in (("d1", "1"), ("d2", "32")):
                b.start("decode", name, "--local-segment-size", "64MiB",
                        "--drain-timeout", "1.5", "--max-batch", batch)
            b.wait_ready("p", "d1", "d2")
            yield b
        finally:
            for p in b.procs.values():
                if p.alive():
                    store.kill(p)


def _decode_request(rid: str, tokens: list[int], first: int, sampling: pb.Sampling,
                    tail_key: str, plan: pb.KVPlan, tenant: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, token_ids=tokens, first_token=first,
                            sampling=sampling, tail_key=tail_key, plan=plan, tenant=tenant)


def _undisturbed(bed: Bed, sampling: pb.Sampling) -> list[int]:
    """The first COMPARED tokens of an undisturbed run."""
    rid = uuid.uuid4().hex
    plan = bed.plan(PROMPT, "reference")
    cut = pb.Sampling()
    cut.CopyFrom(sampling)
    cut.max_tokens = COMPARED
    sampling = cut
    pre = bed.prefill(rid, PROMPT, sampling, plan, "reference")
    s = Stream(bed, "d2", _decode_request(rid, PROMPT, pre.first_token, sampling,
                                          pre.tail_key, plan, "reference"))
    return [pre.first_token, *s.tokens()]


def test_a_draining_decode_hands_streams_over_and_another_continues_them(bed: Bed) -> None:
    with ThreadPoolExecutor(len(SAMPLINGS)) as pool:  # batched on d2, as streams are
        futures = {k: pool.submit(_undisturbed, bed, s) for k, s in SAMPLINGS.items()}
        want = {k: f.result() for k, f in futures.items()}
    assert all(len(w) == COMPARED for w in want.values())

    # The prompt's KV lives only on d1's own segment (another tenant's keys than the
    # reference's, the same KV): d1 must write it again elsewhere before it goes.
    d1_segment = bed.load("d1").local_segment
    assert d1_segment
    tenant = "handed"
    streams: dict[str, tuple[list[int], Stream]] = {}
    for kind, sampling in SAMPLINGS.items():
        rid = f"{kind}-{uuid.uuid4().hex}"
        plan = bed.plan(PROMPT, tenant, write_segment=d1_segment)
        pre = bed.prefill(rid, PROMPT, sampling, plan, tenant)
        req = _decode_request(rid, PROMPT, pre.first_token, sampling, pre.tail_key, plan,
                              tenant)
        streams[kind] = ([pre.first_token], Stream(bed, "d1", req))
        if kind == "greedy":  # running before the other one comes: that one waits for room
            assert streams[kind][1].started.wait(120)
    deadline = time.monotonic() + 60
    while bed.load("d1").waiting < 1:
        assert time.monotonic() < deadline, "the second stream never queued on d1"
        time.sleep(0.05)
    prefill_before = bed.procs["p"].metrics()

    d1 = bed.procs["d1"]
    os.killpg(d1.popen.pid, signal.SIGTERM)
    assert d1.popen.wait(60) == 0, d1.log()[-3000:]
    bt = bed.info().block_tokens
    handed: dict[str, tuple[list[int], pb.DecodeHandoff]] = {}
    for kind, (first, s) in streams.items():
        chunks = s.join()
        last = chunks[-1]
        assert last.HasField("handoff"), f"{kind}: the stream ended without a handoff"
        assert all(not c.HasField("handoff") and not c.finished for c in chunks[:-1])
        streamed = [*first, *(c.token_id for c in chunks[:-1])]
        h = last.handoff
        context = PROMPT + streamed[:-1]
        assert h.reason == "drain" and h.context_tokens == len(context)
        assert h.stored_blocks == len(context) // bt
        assert bool(h.tail_key) == bool(len(context) % bt)
        assert len(streamed) < COMPARED  # handed over at once: the resumed part is compared
        handed[kind] = (streamed, h)
    assert len(handed["seeded"][0]) == 1  # it never ran on d1: handed over from the queue
    assert len(handed["greedy"][0]) > READ_BEFORE_STOP
    resumed: dict[str, Stream] = {}
    for kind, (streamed, h) in handed.items():
        # Resumed as the Conductor does: the same seed, max_tokens cut by what was produced.
        context, nxt = PROMPT + streamed[:-1], streamed[-1]
        left = pb.Sampling()
        left.CopyFrom(SAMPLINGS[kind])
        left.max_tokens = MAX_TOKENS - (len(streamed) - 1)
        req = _decode_request(f"{kind}-r1", context, nxt, left, h.tail_key,
                              bed.plan(context, tenant), tenant)
        resumed[kind] = Stream(bed, "d2", req, limit=COMPARED - len(streamed))
    for kind, (streamed, _) in handed.items():
        got = streamed + resumed[kind].tokens()
        assert got == want[kind], f"{kind}: the resumed stream differs from the undisturbed one"

    d2 = bed.procs["d2"].metrics()
    assert metric_value(d2, "mooncake_decode_recomputed_tokens_total") == 0
    prefill_after = bed.procs["p"].metrics()
    for source in ("computed", "cache"):  # no prefill call was made for the resumes
        label = f'source="{source}"'
        assert (metric_value(prefill_after, "mooncake_prefill_tokens_total", label)
                == metric_value(prefill_before, "mooncake_prefill_tokens_total", label))
    with bed.store.client() as c:  # the loader removed the handed-over tails, as after prefill
        tails = [h.tail_key for _, h in handed.values()]
        assert not any(c.exists([t])[0] for t in tails if t)


def test_a_draining_prefill_refuses_what_it_cannot_finish_with_unavailable(bed: Bed) -> None:
    """Prompts queued behind a long one when the grace (1 s) ends get UNAVAILABLE, saying
    why; the prefill then exits cleanly."""
    long = [1, *((i * 104729) % 40000 + 100 for i in range(1999))]
    outcomes: list[tuple[grpc.StatusCode, str]] = []

    def call(i: int) -> None:
        with bed.channel("p") as ch:
            try:
                serving_rpc.stub("prefill", ch).Prefill(
                    pb.PrefillRequest(request_id=f"long-{i}", token_ids=[*long, i + 5],
                                      sampling=pb.Sampling(temperature=0, max_tokens=4)),
                    metadata=call_metadata(TOKEN), timeout=120)
                outcomes.append((grpc.StatusCode.OK, ""))
            except grpc.RpcError as e:
                outcomes.append((e.code(), e.details() or ""))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while bed.load("p").queued_requests < 3:
        assert time.monotonic() < deadline, "the prompts never queued"
        time.sleep(0.05)
    p = bed.procs["p"]
    os.killpg(p.popen.pid, signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert p.popen.wait(60) == 0, p.log()[-3000:]
    assert len(outcomes) == 3
    refused = [d for code, d in outcomes if code == grpc.StatusCode.UNAVAILABLE]
    assert all(code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
               for code, _ in outcomes), outcomes
    assert len(refused) >= 2, outcomes  # at least the two queued behind the first
    assert all("draining" in d for d in refused), refused
