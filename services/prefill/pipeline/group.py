"""A worker's stage of a prefill group: its engine stage, inbox, link to the next stage, health.

One `StageRuntime` per prefill worker with `--pipeline-group-size > 1`. Stage 0 (the leader)
checks the group with `Hello` down the chain every `HEALTH_INTERVAL_S`: the group is whole
(`LoadReport.pipeline_whole`, the Conductor routes to it) only while every later stage answers
with the same model, revision, group and layer split. A prompt that fails on another stage
takes the group out of rotation at once; the next successful check puts it back (a restarted
stage announces a new inbox, which the check also refreshes).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc
import torch
from prometheus_client import Counter, Gauge

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.common.rpcserver import MAX_MESSAGE
from mooncake_k8s.prefill.pipeline.config import stage_layers
from mooncake_k8s.prefill.pipeline.inbox import DEFAULT_SLOTS, Inbox, InboxTarget, StageFailed
from mooncake_k8s.prefill.pipeline.link import Downstream, rpc_failure

if TYPE_CHECKING:
    from mooncake_k8s.worker.base import PrefillWorker

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
"""How often the leader checks the chain: a restarted stage is back in rotation within it."""


class StageMetrics:
    """The per-stage series of the design note, on the worker's registry."""

    def __init__(self, registry: Any) -> None:
        self.busy = Counter("mooncake_prefill_stage_busy_seconds", "Seconds this pipeline "
                            "stage computed prompts' layers", registry=registry)
        self.bubble = Counter("mooncake_prefill_stage_bubble_seconds", "Seconds this pipeline "
                              "stage waited inside a prompt's span (the pipeline bubble)",
                              registry=registry)
        self.bytes = Counter("mooncake_prefill_stage_bytes", "Bytes this stage passed: hidden "
                             "states in and out, KV written to the pool", ["direction"],
                             registry=registry)
        self.whole = Gauge("mooncake_prefill_group_whole", "Leader: 1 while every stage of the "
                           "group answers its checks", registry=registry)
        self.failures = Counter("mooncake_prefill_stage_failures", "Prompts failed by another "
                                "stage, by cause", ["cause"], registry=registry)

    def account(self, stats: pb.StageStats) -> None:
        """A prompt's time and KV bytes (hidden-state bytes are counted as they move)."""
        self.busy.inc(stats.busy_s)
        self.bubble.inc(stats.idle_s)
        self.bytes.labels("kv").inc(stats.kv_bytes)


class StageClock:
    """Busy and idle time of one stage over one prompt's span."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy = 0.0

    def timed(self) -> _Timed:
        return _Timed(self)

    def stats(self, stage: int, lo: int, hi: int, **kw: int) -> pb.StageStats:
        span = time.monotonic() - self.t0
        return pb.StageStats(stage=stage, layer_lo=lo, layer_hi=hi, busy_s=self.busy,
                             idle_s=max(span - self.busy, 0.0), **kw)


class _Timed:
    def __init__(self, clock: StageClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.t = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.clock.busy += time.monotonic() - self.t


class StageRuntime:
    """What the stage server and the leader share on one worker."""

    def __init__(self, worker: PrefillWorker) -> None:
        cfg = worker.config
        self.worker = worker
        self.group = cfg.pipeline_group
        self.size = cfg.pipeline_group_size
        self.index = cfg.pipeline_stage
        self.timeout_s = cfg.pipeline_stage_timeout_s
        self.chunk_tokens = cfg.pipeline_chunk_tokens
        self.chunks = cfg.pipeline_chunks
        self.last = self.index == self.size - 1
        self.metrics = StageMetrics(worker.registry)
        self.stage: Any = None
        """The engine's `EmbeddedStage` once the model is loaded."""
        self.adapter: Any = None
        """The worker's embedded engine (set before the worker's own `engine`)."""
        self.inbox: Inbox | None = None
        self.lock = threading.Lock()
        """One prompt at a time through this stage."""
        self.whole = False
        self._target: InboxTarget | None = None
        self._channel: grpc.Channel | None = None
        if not self.last:
            self._channel = grpc.insecure_channel(cfg.pipeline_next, options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE)])
        self._stop = threading.Event()

    # -- start-up ----------------------------------------------------------------------------

    def on_engine_loaded(self, adapter: Any) -> None:
        """Build the engine stage and (stages > 0) the inbox; the leader starts its checks."""
        from mooncake_k8s.engine.embedded.stage import EmbeddedStage

        self.adapter = adapter
        engine = adapter.engine
        if self.chunk_tokens % engine.chunk_tokens:
            raise ValueError(f"--pipeline-chunk-tokens {self.chunk_tokens} is not a multiple "
                             f"of the engine's prefill chunk ({engine.chunk_tokens} tokens)")
        self.stage = EmbeddedStage(engine, self.worker.store, self.index, self.size)
        if self.index > 0:
            cfg = self.worker.config
            # Unique on the host as the worker's own segment is: instance and gRPC port.
            name = f"pipe-{self.group}-{self.index}-{cfg.instance_id}-{self.worker.port}"[-100:]
            self.inbox = Inbox(name, DEFAULT_SLOTS, self.stage.hidden_bytes(self.chunk_tokens),
                               host=cfg.host, advertise_host=cfg.advertise_host,
                               token=cfg.token, host_id=self.worker.host_id)
        else:
            threading.Thread(target=self._health_loop, name="pipeline-health",
                             daemon=True).start()

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.engine.model.dtype  # type: ignore[no-any-return]

    @property
    def num_layers(self) -> int:
        return int(self.adapter.engine.model.num_layers)

    def layers(self, stage: int) -> tuple[int, int]:
        return stage_layers(self.num_layers, self.size, stage)

    def close(self) -> None:
        self._stop.set()
        if self.inbox is not None:
            self.inbox.close()
        if self._channel is not None:
            self._channel.close()

    # -- the chain ---------------------------------------------------------------------------

    def hello_request(self, stage: int) -> pb.StageHello:
        info = self.adapter.info
        return pb.StageHello(group=self.group, group_size=self.size, stage=stage,
                             model_fingerprint=info.fingerprint,
                             revision=self.worker.config.revision, num_layers=self.num_layers)

    def hello_next(self) -> pb.StageHelloReply:
        """Check the rest of the chain (one Hello; each stage passes it on) and remember the
        next stage's inbox. A failure reply names the stage that refused."""
        assert self._channel is not None
        stub = pb_grpc.PrefillStageStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            reply: pb.StageHelloReply = stub.Hello(
                self.hello_request(self.index + 1), timeout=self.timeout_s,
                metadata=call_metadata(self.worker.config.token))
        except grpc.RpcError as e:
            self._target = None
            return pb.StageHelloReply(ok=False, stage=self.index + 1, problem=str(
                rpc_failure(e, f"stage {self.index + 1} at {self.worker.config.pipeline_next}")))
        if reply.ok:
            self._target = InboxTarget.from_reply(reply)
        else:
            self._target = None
        return reply

    def open_downstream(self) -> Downstream:
        """The stream to the next stage for one prompt (a Hello first when its inbox is not
        known, or no longer valid)."""
        assert self._channel is not None
        if self._target is None:
            reply = self.hello_next()
            if not reply.ok:
                raise StageFailed(f"prefill group {self.group} is not whole: {reply.problem}",
                                  "unhealthy")
        assert self._target is not None
        return Downstream(self._channel, self.worker.config.token, self._target,
                          self.worker.store.engine, self.timeout_s,
                          self.worker.config.pipeline_next,
                          self.metrics.bytes.labels("out").inc)

    def failed(self, e: StageFailed) -> None:
        """A prompt failed on another stage: count it, and the leader leaves rotation until
        the next check succeeds (the inbox is looked up anew, too)."""
        self.metrics.failures.labels(e.cause).inc()
        self._target = None
        if self.index == 0:
            self._set_whole(False, str(e))

    def _set_whole(self, whole: bool, why: str = "") -> None:
        if whole != self.whole:
            (log.info if whole else log.warning)(
                f"prefill group {self.group} is {'whole' if whole else 'not whole'}",
                extra={"problem": why} if why else None)
        self.whole = whole
        self.metrics.whole.set(1 if whole else 0)

    def _health_loop(self) -> None:
        while not self._stop.wait(0 if not self.whole else HEALTH_INTERVAL_S):
            if self.worker.draining.is_set():
                return
            try:
                reply = self.hello_next()
            except Exception as e:  # never let the check die: the group would stay as it is
                log.exception("pipeline health check failed")
                reply = pb.StageHelloReply(ok=False, problem=f"{type(e).__name__}: {e}")
            self._set_whole(reply.ok, reply.problem)
            if not reply.ok:
                self._stop.wait(HEALTH_INTERVAL_S)

    def fill_report(self, report: pb.LoadReport) -> None:
        report.pipeline_group = self.group
        report.pipeline_stage = self.index
        report.pipeline_group_size = self.size
        report.pipeline_whole = self.whole
