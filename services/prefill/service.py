"""The prefill service: follow the Conductor's KV plan, compute the rest, hand the KV on.

One engine thread runs prefills first come, first served (prefill is compute-bound: two at once
would only share the cores and both be late). The gRPC threads queue a job and wait for it,
so the load report can say how many prompt tokens are ahead of a new request: the Conductor's
queueing estimate.

The engine (any kind, `engine.api`) reads the blocks the plan names, verifies them and
recomputes anything missing or corrupt: a cache miss costs time, never correctness. A plan made
in another key namespace is not trusted (the keys are computed here instead, and counted).

With `local_segment_size` the worker also serves a DRAM segment of the pool on its host
(`worker.base`): the engine keeps the prefixes it computes there (the plan's `home_segment`)
beside the copy it writes for decode, so a repeat routed to this host reads shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from mooncake_k8s.common import tracing
from mooncake_k8s.common.errors import InvalidArgument, MooncakeError, StoreError
from mooncake_k8s.common.metrics import LATENCY_BUCKETS
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.common.serving_rpc import servicer_handler
from mooncake_k8s.engine.api import EngineFailed, PrefillWork, resolve_plan
from mooncake_k8s.prefill.pipeline.group import StageRuntime
from mooncake_k8s.prefill.pipeline.inbox import StageFailed
from mooncake_k8s.prefill.pipeline.leader import Leader
from mooncake_k8s.prefill.pipeline.server import StageServicer
from mooncake_k8s.worker.base import PrefillWorker, WorkerConfig, run_worker

log = logging.getLogger(__name__)


class _Servicer(pb_grpc.PrefillServicer):
    """The generated `Prefill` service (`proto/serving.proto`), answered by the worker."""

    def __init__(self, service: PrefillService) -> None:
        self._service = service

    def Prefill(self, request: pb.PrefillRequest,
                context: grpc.ServicerContext) -> pb.PrefillResponse:
        return self._service.prefill(request, context)

    def Load(self, request: pb.LoadRequest,
             context: grpc.ServicerContext) -> pb.LoadReport:
        return self._service.report()


class _Handlers(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Several generated services on one server (Prefill, and PrefillStage in a group)."""

    def __init__(self, *handlers: grpc.GenericRpcHandler) -> None:  # type: ignore[type-arg]
        self._handlers = handlers

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        for h in self._handlers:
            found = h.service(details)
            if found is not None:
                return found
        return None


@dataclass(eq=False)
class _Job:
    request: pb.PrefillRequest
    trace: dict[str, str]
    queued_at: float = field(default_factory=time.monotonic)
    done: Future[pb.PrefillResponse] = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the caller's RPC ends (the client went away): a queued job is then skipped."""


STOP_WAIT_S = 5.0
"""How long stopping waits for the prompt being computed (halted at a drain's end) before the
store it writes to is closed."""


class _GaveUp(MooncakeError):
    """The drain's grace ended before the prompt was computed (the Conductor retries it)."""


class PrefillService(PrefillWorker):
    role = "prefill"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._queued_tokens = 0
        self._queued_requests = 0
        self._qlock = threading.Lock()
        self._engine_thread: threading.Thread | None = None
        self._open: set[_Job] = set()
        """Jobs queued or computing: what `give_up` ends at the drain's end."""
        r = self.registry
        self.m_requests = Counter("mooncake_prefill_requests_total", "Prefill requests",
                                  ["result"], registry=r)
        self.m_tokens = Counter("mooncake_prefill_tokens_total", "Prompt tokens by source",
                                ["source"], registry=r)
        self.m_blocks = Counter("mooncake_prefill_blocks_total", "KV blocks by outcome",
                                ["outcome"], registry=r)
        self.m_latency = Histogram("mooncake_prefill_seconds", "Prefill phases", ["phase"],
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.m_queue = Gauge("mooncake_prefill_queued_tokens", "Prompt tokens queued",
                             registry=r)
        self.m_plans = Counter("mooncake_prefill_plans_total",
                               "Conductor plans: followed, or not trusted (keys recomputed)",
                               ["outcome"], registry=r)
        self.pipeline = StageRuntime(self) if config.pipelined else None
        """This worker's stage of a prefill group (None: a single instance)."""
        self.leader = Leader(self.pipeline) if self.pipeline and self.pipeline.index == 0 \
            else None

    def on_engine_loaded(self, engine: Any) -> None:
        if self.pipeline is not None:
            self.pipeline.on_engine_loaded(engine)
        self._engine_thread = threading.Thread(target=self._run, name="prefill-engine",
                                               daemon=True)
        self._engine_thread.start()

    def handlers(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        prefill = servicer_handler(pb_grpc.add_PrefillServicer_to_server, _Servicer(self))
        if self.pipeline is None:
            return prefill
        stage = servicer_handler(pb_grpc.add_PrefillStageServicer_to_server,
                                 StageServicer(self.pipeline))
        return _Handlers(prefill, stage)

    def report(self) -> pb.LoadReport:
        rep = self.load_report()
        if self.pipeline is not None:
            self.pipeline.fill_report(rep)
        with self._qlock:
            rep.queued_tokens = self._queued_tokens
            rep.queued_requests = self._queued_requests
        return rep

    def give_up(self) -> None:
        """The grace is over: every prompt still queued or computing ends UNAVAILABLE now, and
        an engine that can stops computing (so the process exits with nothing running)."""
        with self._qlock:
            jobs = list(self._open)
        for job in jobs:
            with contextlib.suppress(InvalidStateError):
                job.done.set_exception(_GaveUp("the drain's grace ended first"))
        halt = getattr(self.engine, "halt", None)
        if halt is not None:
            halt()

    def stop(self) -> None:
        self._jobs.put(None)
        if self._engine_thread is not None:  # a halted prefill ends within a chunk
            self._engine_thread.join(STOP_WAIT_S)
        super().stop()
        if self.pipeline is not None:
            self.pipeline.close()

    # -- the RPC ---------------------------------------------------------------------------

    def prefill(self, req: pb.PrefillRequest, ctx: grpc.ServicerContext) -> pb.PrefillResponse:
        rt = self.pipeline
        if rt is not None and rt.index > 0:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this is stage {rt.index} of prefill group {rt.group!r}: only its "
                      "leader (stage 0) takes Prefill calls")
        engine = self.admit(ctx)
        try:
            if not req.token_ids:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
            if len(req.token_ids) > engine.info.max_context:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt of {len(req.token_ids)} tokens exceeds the model's context "
                          f"of {engine.info.max_context}")
            job = _Job(req, dict(req.trace_context))
            ctx.add_callback(job.cancelled.set)  # also runs after success: harmless by then
            with self._qlock:
                self._queued_tokens += len(req.token_ids)
                self._queued_requests += 1
                self.m_queue.set(self._queued_tokens)
                self._open.add(job)
            self._jobs.put(job)
            try:
                return job.done.result()
            except Exception as e:
                self._abort(ctx, e)
            raise AssertionError("unreachable")
        finally:
            self.release()

    def _abort(self, ctx: grpc.ServicerContext, err: Exception) -> None:
        """End the call with the status the job's failure maps to (counted)."""
        try:
            raise err
        except CancelledError:  # skipped: the caller went away (counted by _run)
            ctx.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        except _GaveUp as e:
            self.m_requests.labels("drained").inc()
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"prefill is draining: {e}")
        except InvalidArgument as e:
            self.m_requests.labels("invalid").inc()
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StageFailed as e:
            self.m_requests.labels("stage_failed").inc()
            group = self.config.pipeline_group
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"prefill group {group!r} failed: {e}")
        except StoreError as e:
            self.m_requests.labels("store_error").inc()
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"KV handoff failed: {e}")
        except EngineFailed as e:
            self.m_requests.labels("engine_failed").inc()
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"prefill engine failed: {e}")
        except Exception as e:
            self.m_requests.labels("error").inc()
            ctx.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(e).__name__}: {e}")

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.done.done():  # given up on at the drain's end
                    continue
                if job.cancelled.is_set():  # nobody waits for it: compute nothing
                    self.m_requests.labels("cancelled").inc()
                    job.done.cancel()
                    continue
                result = self._execute(job)
                with contextlib.suppress(InvalidStateError):  # given up on meanwhile
                    job.done.set_result(result)
                    self.m_requests.labels("ok").inc()
            except Exception as e:
                if not isinstance(e, MooncakeError):
                    log.exception("prefill failed", extra={"request_id": job.request.request_id})
                with contextlib.suppress(InvalidStateError):
                    job.done.set_exception(e)
            finally:
                with self._qlock:
                    self._open.discard(job)
                    self._queued_tokens -= len(job.request.token_ids)
                    self._queued_requests -= 1
                    self.m_queue.set(self._queued_tokens)

    def _execute(self, job: _Job) -> pb.PrefillResponse:
        engine = self.loaded()
        req = job.request
        started = time.monotonic()
        tokens = list(req.token_ids)
        with tracing.span("prefill", job.trace, request_id=req.request_id,
                          prompt_tokens=len(tokens)) as sp:
            plan, trusted = resolve_plan(req.plan, engine.info, tokens, req.tenant,
                                         req.use_prefix_cache)
            if req.plan.planned:
                self.m_plans.labels("followed" if trusted else "untrusted").inc()
            work = PrefillWork(req.request_id, tokens, req.tenant, req.sampling, plan,
                               req.use_prefix_cache, job.trace)
            stages: list[pb.StageStats] = []
            if self.leader is not None:
                res, stages = self.engine_call(self.leader.prefill, work)
            else:
                res = self.engine_call(engine.prefill, work)
            sp.set_attribute("cached_tokens", res.cached_tokens)
        self.m_blocks.labels("imported").inc(res.imported_blocks)
        self.m_blocks.labels("rejected").inc(res.rejected_blocks)
        self.m_blocks.labels("stored").inc(res.stored_blocks)
        self.m_tokens.labels("cache").inc(res.cached_tokens)
        self.m_tokens.labels("computed").inc(res.computed_tokens)
        queue_s = started - job.queued_at
        for phase, secs in (("queue", queue_s), ("load", res.load_s),
                            ("compute", res.compute_s), ("store", res.store_s)):
            self.m_latency.labels(phase).observe(secs)
        return pb.PrefillResponse(
            first_token=res.first_token, text=res.text, finished=res.finished,
            finish_reason=res.finish_reason, prompt_tokens=len(tokens),
            cached_tokens=res.cached_tokens, computed_tokens=res.computed_tokens,
            tail_key=res.tail_key, stored_blocks=res.stored_blocks,
            rejected_blocks=res.rejected_blocks, queue_ms=queue_s * 1e3,
            load_ms=res.load_s * 1e3, compute_ms=res.compute_s * 1e3,
            store_ms=res.store_s * 1e3, stages=stages,
        )


def run_prefill(config: WorkerConfig) -> None:
    run_worker(PrefillService(config))
