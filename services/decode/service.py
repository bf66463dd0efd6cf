"""The decode service: load a request's KV, join the engine's running batch, stream tokens.

The engine (any kind, `engine.api`) loads the prompt's blocks by the keys of the Conductor's plan
(the very `KVPlan` the prefill call carried, judged by the same `resolve_plan`: computed here
only when the plan's namespace is not this engine's) and streams the tokens after the first; a
client that goes away cancels its sequence.

With `local_segment_size` the decode process also serves a DRAM segment to the store
(`worker.base`); prefill writes a request's blocks there, so the KV this instance reads is
usually a local shared-memory copy, and a block it had to read from another host is kept there
when the plan says `keep_fetched` (hot-block replication).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from mooncake_k8s.common import tracing
from mooncake_k8s.common.errors import InvalidArgument, StoreError
from mooncake_k8s.common.metrics import LATENCY_BUCKETS
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.common.serving_rpc import servicer_handler
from mooncake_k8s.engine.api import DecodeWork, EngineFailed, Handoff, KVMissing, resolve_plan
from mooncake_k8s.worker.base import DecodeWorker, WorkerConfig, run_worker

log = logging.getLogger(__name__)


class _Servicer(pb_grpc.DecodeServicer):
    """The generated `Decode` service (`proto/serving.proto`), answered by the worker."""

    def __init__(self, service: DecodeService) -> None:
        self._service = service

    def Decode(self, request: pb.DecodeRequest,
               context: grpc.ServicerContext) -> Iterator[pb.DecodeChunk]:
        return self._service.decode(request, context)

    def Load(self, request: pb.LoadRequest,
             context: grpc.ServicerContext) -> pb.LoadReport:
        return self._service.report()


class DecodeService(DecodeWorker):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        r = self.registry
        self.m_requests = Counter("mooncake_decode_requests_total", "Decode requests",
                                  ["result"], registry=r)
        self.m_tokens = Counter("mooncake_decode_tokens_total", "Tokens generated", registry=r)
        self.m_step = Histogram("mooncake_decode_step_seconds", "One batched decode step",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.m_load = Histogram("mooncake_decode_kv_load_seconds",
                                "Request admission: KV load until the first streamed token",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.m_running = Gauge("mooncake_decode_running", "Sequences in the batch", registry=r)
        self.m_cancelled = Counter("mooncake_decode_cancelled_total",
                                   "Streams whose client went away before the end", registry=r)
        self.m_kv_free = Gauge("mooncake_decode_kv_free_tokens",
                               "Tokens of KV the engine has free", registry=r)
        self.m_handoffs = Counter(
            "mooncake_decode_handoffs_total", "Streams handed over to another instance through "
            "the pool at drain: handed_off, or failed (the stream took the failover path)",
            ["outcome"], registry=r)
        self.m_handoff_tokens = Counter(
            "mooncake_decode_handoff_context_tokens_total",
            "Context tokens of handed-over streams (their KV written to or kept in the pool)",
            registry=r)
        self.m_plans = Counter("mooncake_decode_plans_total",
                               "Conductor plans: followed, or not trusted (keys recomputed)",
                               ["outcome"], registry=r)
        self.accepted_streams = 0
        """Decode streams admitted since start (`LoadReport.accepted_streams`)."""
        self._accepted_lock = threading.Lock()

    def handlers(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        return servicer_handler(pb_grpc.add_DecodeServicer_to_server, _Servicer(self))

    def report(self) -> pb.LoadReport:
        rep = self.load_report()
        rep.accepted_streams = self.accepted_streams
        if self.engine is not None:
            load = self.engine.load()
            rep.running = load.running + load.waiting
            rep.waiting = load.waiting
            rep.queued_tokens = load.waiting_tokens
            rep.kv_free_tokens = load.kv_free_tokens
            rep.kv_capacity_tokens = load.kv_capacity_tokens
            self.m_running.set(load.running)
            self.m_kv_free.set(load.kv_free_tokens)
            for secs in self.engine.step_seconds():
                self.m_step.observe(secs)
        return rep

    # -- the RPC ---------------------------------------------------------------------------

    def _work(self, req: pb.DecodeRequest) -> DecodeWork:
        """The engine's work, following the request's plan as `resolve_plan` judges it (the
        one rule prefill follows too): its keys when made in this engine's namespace."""
        tokens = list(req.token_ids)
        plan, trusted = resolve_plan(req.plan, self.loaded().info, tokens, req.tenant, True)
        if req.plan.planned:
            self.m_plans.labels("followed" if trusted else "untrusted").inc()
        return DecodeWork(req.request_id, tokens, req.tenant, req.first_token, req.sampling,
                          list(plan.keys), req.tail_key, dict(req.trace_context),
                          plan.bootstrap_addr, plan.bootstrap_room,
                          keep_on=self.local_segment if plan.keep_fetched else "")

    def decode(self, req: pb.DecodeRequest, ctx: grpc.ServicerContext) -> Iterator[pb.DecodeChunk]:
        engine = self.admit(ctx)
        with self._accepted_lock:
            self.accepted_streams += 1
        cancelled = threading.Event()
        ctx.add_callback(cancelled.set)
        t0 = time.monotonic()
        first = True
        finished = handed = False
        tokens: Iterator[Any] | None = None
        try:
            with tracing.span("decode", dict(req.trace_context), request_id=req.request_id):
                tokens = self.watched(engine.decode(self._work(req), cancelled))
                for item in tokens:
                    if first:
                        self.m_load.observe(time.monotonic() - t0)
                        first = False
                    if item.handoff is not None:
                        handed = True
                        yield self._handoff_chunk(item.handoff)
                        break
                    self.m_tokens.inc()
                    finished = item.finished
                    yield pb.DecodeChunk(token_id=item.token_id, text=item.text,
                                         finished=item.finished,
                                         finish_reason=item.finish_reason or "")
                    if finished:
                        break
            if finished:
                self.m_requests.labels("ok").inc()
            elif handed:
                self.m_requests.labels("handoff").inc()
            elif cancelled.is_set():
                self._count_cancelled()
        except GeneratorExit:
            # gRPC stops iterating a cancelled call and closes this generator at its `yield`
            # (the client went away): end the engine's sequence now, which frees its KV.
            cancelled.set()
            self._count_cancelled()
            raise
        except InvalidArgument as e:
            self.m_requests.labels("invalid").inc()
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVMissing as e:
            self.m_requests.labels("kv_missing").inc()
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (StoreError, EngineFailed) as e:
            self.m_requests.labels("unavailable").inc()
            if self.handing_over(req.request_id):
                self.m_handoffs.labels("failed").inc()
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"decode failed: {e}")
        except Exception as e:
            self.m_requests.labels("error").inc()
            log.exception("decode failed", extra={"request_id": req.request_id})
            ctx.abort(grpc.StatusCode.INTERNAL, f"decode failed: {type(e).__name__}: {e}")
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()
            self.release()

    def _handoff_chunk(self, h: Handoff) -> pb.DecodeChunk:
        """The last message of a handed-over stream (token fields unset)."""
        self.m_handoffs.labels("handed_off").inc()
        self.m_handoff_tokens.inc(h.context_tokens)
        return pb.DecodeChunk(handoff=pb.DecodeHandoff(
            context_tokens=h.context_tokens, tail_key=h.tail_key,
            stored_blocks=h.stored_blocks, reason=h.reason))

    def _count_cancelled(self) -> None:
        self.m_cancelled.inc()
        self.m_requests.labels("cancelled").inc()


def run_decode(config: WorkerConfig) -> None:
    run_worker(DecodeService(config))
