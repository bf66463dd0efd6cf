"""A prefill group of two stages (issue 21) against a single instance, all real processes on
loopback: a store master and node, `mooncake prefill` stage 0 (the leader) and stage 1 with the
pipeline flags, and a plain `mooncake prefill`.

A prompt prefilled through the group gives the single instance's first token and stores blocks
byte-identical to the single instance's (read back through the store); a prefix either one
cached is reused by the other; stage 1 refuses Prefill calls; a stage killed mid-prompt fails
the leader's call with UNAVAILABLE (retriable) and takes the group out of rotation until the
stage is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.engine.api import EngineInfo
from mooncake_k8s.store.testing import StoreCluster, metric_value
from mooncake_k8s.testbed.cluster import http_ok

pytestmark = pytest.mark.timeout(600)
TOKEN = "group-test-token"
STAGE_TIMEOUT_S = 5.0
SHORT = [1, *range(300, 340)]
LONG = [1, *((i * 7919) % 40000 + 100 for i in range(699))]


@dataclass
class Bed:
    store: StoreCluster
    workdir: Path
    procs: dict[str, Proc]
    ports: dict[str, int]
    args: dict[str, list[str]]

    def start(self, name: str) -> Proc:
        mport = free_port()
        args = ["prefill", "--master", self.store.master_address, "--port",
                str(self.ports[name]), "--metrics-port", str(mport), "--instance-id", name,
                "--threads", "1", "--log-format", "text", "--local-segment-size", "0",
                *self.args[name]]
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen([sys.executable, "-m", "mooncake_k8s.cli", *args],
                                     stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.procs[name] = Proc(name, args, popen, log_path, mport)
        return self.procs[name]

    def wait_ready(self, *names: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            p = self.procs[name]
            while not http_ok(f"http://127.0.0.1:{p.metrics_port}/readyz"):
                assert p.alive(), p.log()[-3000:]
                assert time.monotonic() < deadline, f"{name} not ready"
                time.sleep(0.2)

    def stub(self, name: str) -> tuple[grpc.Channel, object]:
        ch = grpc.insecure_channel(f"127.0.0.1:{self.ports[name]}")
        return ch, serving_rpc.stub("prefill", ch)

    def prefill(self, name: str, tokens: list[int], *, tenant: str = "",
                cache: bool = True, rid: str = "") -> pb.PrefillResponse:
        """One Prefill call (a fresh request id: the tail's key is the request's)."""
        rid = rid or uuid.uuid4().hex
        ch, stub = self.stub(name)
        with ch:
            resp: pb.PrefillResponse = stub.Prefill(  # type: ignore[attr-defined]
                pb.PrefillRequest(request_id=rid, token_ids=tokens, tenant=tenant,
                                  use_prefix_cache=cache,
                                  sampling=pb.Sampling(temperature=0, max_tokens=8)),
                metadata=call_metadata(TOKEN), timeout=300)
        return resp

    def load(self, name: str) -> pb.LoadReport:
        ch, stub = self.stub(name)
        with ch:
            rep: pb.LoadReport = stub.Load(  # type: ignore[attr-defined]
                pb.LoadRequest(), metadata=call_metadata(TOKEN), timeout=10)
        return rep

    def wait_whole(self, whole: bool, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.load("s0").pipeline_whole != whole:
            assert time.monotonic() < deadline, f"pipeline_whole never turned {whole}"
            time.sleep(0.1)

    def info(self) -> EngineInfo:
        r = self.load("single")
        return EngineInfo(r.engine, r.model, r.model_fingerprint, r.dtype, r.block_tokens,
                          r.max_context, kv_layout=r.kv_layout)

    def stored(self, tokens: list[int], tenant: str, tail_key: str) -> list[bytes]:
        """The prompt's blocks as the store holds them (full blocks, then the tail)."""
        keys = self.info().block_keys(tokens, tenant) + ([tail_key] if tail_key else [])
        with self.store.client() as c:
            return [bytes(c.get(k)) for k in keys]

    def drop(self, tokens: list[int], tenant: str, tail_key: str) -> None:
        keys = self.info().block_keys(tokens, tenant) + ([tail_key] if tail_key else [])
        with self.store.client() as c:
            c.remove(keys, force=True)


def _first_difference(got: list[bytes], want: list[bytes]) -> tuple[int, int, int, int] | None:
    """(object, byte offset, its length here, there) of the first difference, None if equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            off = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                       min(len(a), len(b)))
            return i, off, len(a), len(b)
    return None


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with StoreCluster(token=TOKEN) as store:
        store.start_master()
        store.start_node("n0", "512MiB")
        ports = {n: free_port() for n in ("s0", "s1", "single")}
        group = ["--pipeline-group", "g0", "--pipeline-group-size", "2",
                 "--pipeline-stage-timeout", str(STAGE_TIMEOUT_S)]
        args = {"s0": [*group, "--pipeline-stage", "0", "--pipeline-next",
                       f"127.0.0.1:{ports['s1']}"],
                "s1": [*group, "--pipeline-stage", "1"], "single": []}
        b = Bed(store, tmp_path_factory.mktemp("group"), {}, ports, args)
        try:
            for name in ("s1", "s0", "single"):
                b.start(name)
            b.wait_ready("s1", "s0", "single")
            b.wait_whole(True)
            yield b
        finally:
            for p in b.procs.values():
                if p.alive():
                    store.kill(p)


@pytest.mark.parametrize(("tokens", "tenant"), [(SHORT, "short"), (LONG, "long")])
def test_the_group_prefills_as_one_instance(bed: Bed, tokens: list[int], tenant: str) -> None:
    """Same first token, and every stored block (each stage wrote its layers) byte-identical
    to the single instance's."""
    one = bed.prefill("single", tokens, tenant=tenant, cache=False)
    ref = bed.stored(tokens, tenant, one.tail_key)
    assert ref and all(ref)
    bed.drop(tokens, tenant, one.tail_key)
    got = bed.prefill("s0", tokens, tenant=tenant, cache=False)
    assert got.first_token == one.first_token
    assert got.stored_blocks == one.stored_blocks == len(tokens) // bed.info().block_tokens
    assert _first_difference(bed.stored(tokens, tenant, got.tail_key), ref) is None
    assert [s.stage for s in got.stages] == [0, 1]
    assert got.stages[0].layer_lo == 0 and got.stages[0].layer_hi == got.stages[1].layer_lo
    assert got.stages[0].bytes_out == got.stages[1].bytes_in > 0
    assert all(s.busy_s > 0 for s in got.stages)
    assert got.stages[1].kv_bytes > 0


def test_a_prefix_cached_by_either_is_reused_by_the_other(bed: Bed) -> None:
    prefix = LONG[:300]
    for first, second in (("s0", "single"), ("single", "s0")):
        tenant = f"reuse-{first}"
        bed.prefill(first, prefix, tenant=tenant, cache=False)
        longer = [*prefix, *SHORT]
        fresh = bed.prefill(first, longer, tenant=f"{tenant}-cold", cache=False)
        got = bed.prefill(second, longer, tenant=tenant)
        assert got.cached_tokens > 0, (first, second)
        assert got.first_token == fresh.first_token, (first, second)


def test_a_later_stage_refuses_prefill_naming_the_leader(bed: Bed) -> None:
    with pytest.raises(grpc.RpcError) as e:
        bed.prefill("s1", SHORT)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "leader (stage 0)" in (e.value.details() or "")
    rep = bed.load("s1")
    assert (rep.pipeline_group, rep.pipeline_stage, rep.pipeline_group_size) == ("g0", 1, 2)


def test_hello_checks_the_callers_view_of_the_group(bed: Bed) -> None:
    """Stage 1 answers the handshake only for its own group, index, model and revision (with
    its layers and inbox), and only with the cluster token."""
    rep = bed.load("s0")
    good = pb.StageHello(group="g0", group_size=2, stage=1, model_fingerprint=rep.model_fingerprint,
                         revision="", num_layers=30)
    with grpc.insecure_channel(f"127.0.0.1:{bed.ports['s1']}") as ch:
        hello = pb_grpc.PrefillStageStub(ch).Hello  # type: ignore[no-untyped-call]
        ok = hello(good, metadata=call_metadata(TOKEN), timeout=10)
        assert ok.ok and (ok.layer_lo, ok.layer_hi) == (15, 30) and ok.slots > 0
        assert ok.inbox_segment and ok.inbox_address and not ok.problem
        for field, value, needle in (("revision", "r2", "revision"),
                                     ("stage", 0, "stage index"),
                                     ("group", "g1", "group"),
                                     ("model_fingerprint", "00", "model fingerprint")):
            wrong = pb.StageHello()
            wrong.CopyFrom(good)
            setattr(wrong, field, value)
            got = hello(wrong, metadata=call_metadata(TOKEN), timeout=10)
            assert not got.ok and needle in got.problem and "stage 1" in got.problem, got
        with pytest.raises(grpc.RpcError) as e:
            hello(good, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


class _Call(threading.Thread):
    """A long prompt through the group, in the background; started once stage 1 has taken
    hidden states of it (the prompt is mid-pipeline)."""

    def __init__(self, bed: Bed, tenant: str) -> None:
        super().__init__(daemon=True)
        self.bed, self.tenant = bed, tenant
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def run(self) -> None:
        try:
            self.bed.prefill("s0", LONG * 3, tenant=self.tenant, cache=False)
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""

    def start_mid_prompt(self) -> None:
        s1 = self.bed.procs["s1"]
        before = _bytes_in(s1)
        self.start()
        deadline = time.monotonic() + 120
        while _bytes_in(s1) <= before:
            assert time.monotonic() < deadline and self.is_alive(), (self.code, self.details)
            time.sleep(0.02)

    def outcome(self) -> tuple[grpc.StatusCode | None, str]:
        self.join(120)  # a hang guard only: the leader's bound is the stage timeout
        assert not self.is_alive(), "the leader's call hung"
        return self.code, self.details


def _bytes_in(p: Proc) -> float:
    return metric_value(p.metrics(), "mooncake_prefill_stage_bytes_total", 'direction="in"')


def _back_in_rotation(bed: Bed) -> None:
    bed.wait_whole(True)
    assert bed.prefill("s0", SHORT, tenant="back").first_token == bed.prefill(
        "single", SHORT, tenant="back-ref", cache=False).first_token


def test_a_silent_stage_fails_the_prompt_within_the_stage_timeout(bed: Bed) -> None:
    """SIGSTOP: alive to the kernel, silent to everyone (a partition, a hung host)."""
    call = _Call(bed, "paused")
    call.start_mid_prompt()
    bed.store.pause(bed.procs["s1"])
    try:
        code, details = call.outcome()
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "said nothing" in details or "freed no inbox slot" in details, details
        assert not bed.load("s0").pipeline_whole
    finally:
        bed.store.resume(bed.procs["s1"])
    _back_in_rotation(bed)


def test_a_killed_stage_fails_the_prompt_and_the_group_until_it_is_back(bed: Bed) -> None:
    call = _Call(bed, "killed")
    call.start_mid_prompt()
    bed.store.kill(bed.procs["s1"])
    code, details = call.outcome()
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert not bed.load("s0").pipeline_whole
    bed.start("s1")  # the same id and port
    bed.wait_ready("s1")
    _back_in_rotation(bed)


def test_a_stage_whose_leader_dies_mid_prompt_drops_the_prompt(bed: Bed) -> None:
    """The upstream's stream ends (its process is gone): stage 1 aborts the prompt, counts it,
    and serves the restarted leader's next prompt."""
    s1 = bed.procs["s1"]
    hung_up = metric_value(s1.metrics(), "mooncake_prefill_stage_failures_total",
                           'cause="hung_up"')
    call = _Call(bed, "leader-killed")
    call.start_mid_prompt()
    bed.store.kill(bed.procs["s0"])
    code, _ = call.outcome()
    assert code == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 60
    while metric_value(s1.metrics(), "mooncake_prefill_stage_failures_total",
                       'cause="hung_up"') <= hung_up:
        assert time.monotonic() < deadline, "stage 1 never dropped the prompt"
        time.sleep(0.05)
    bed.start("s0")
    bed.wait_ready("s0")
    _back_in_rotation(bed)
