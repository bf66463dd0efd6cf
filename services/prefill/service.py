"""The prefill service: import the cached prefix's KV, compute the rest, hand the KV on.

One engine thread runs prefills first come, first served (prefill is compute-bound: two at once
would only share the cores and both be late). The gRPC threads queue a job and wait for it,
so the load report can say how many prompt tokens are ahead of a new request: the Conductor's
queueing estimate.

A cache miss costs time, never correctness: the store is asked which leading blocks exist, those
are read and verified by the engine, and anything missing or corrupt is recomputed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from mooncake_k8s.common import tracing
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import InvalidArgument, MooncakeError, ObjectExists, StoreError
from mooncake_k8s.common.metrics import LATENCY_BUCKETS
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.worker import Worker, WorkerConfig, run_worker, sampling_from_pb

log = logging.getLogger(__name__)

SERVICE = "mooncake.serving.v1.Prefill"


def tail_key(request_id: str) -> str:
    """Store key of a request's partial last block: request-scoped, never a prefix block."""
    return f"tail/{request_id}"


@dataclass
class _Job:
    request: pb.PrefillRequest
    trace: dict[str, str]
    queued_at: float = field(default_factory=time.monotonic)
    done: Future[pb.PrefillResponse] = field(default_factory=Future)


class PrefillService(Worker):
    role = "prefill"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._queued_tokens = 0
        self._queued_requests = 0
        self._qlock = threading.Lock()
        self._staging = np.empty(0, dtype=np.uint8)
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

    def on_engine_loaded(self, engine: Any) -> None:
        threading.Thread(target=self._run, name="prefill-engine", daemon=True).start()

    def handlers(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Prefill": grpc.unary_unary_rpc_method_handler(
                self.prefill, request_deserializer=pb.PrefillRequest.FromString,
                response_serializer=pb.PrefillResponse.SerializeToString),
            "Load": self.load_handler(self.report),
        })

    def report(self) -> pb.LoadReport:
        rep = self.load_report()
        with self._qlock:
            rep.queued_tokens = self._queued_tokens
            rep.queued_requests = self._queued_requests
        return rep

    def stop(self) -> None:
        self._jobs.put(None)
        super().stop()

    # -- the RPC ---------------------------------------------------------------------------

    def prefill(self, req: pb.PrefillRequest, ctx: grpc.ServicerContext) -> pb.PrefillResponse:
        engine = self.admit(ctx)
        try:
            if not req.token_ids:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
            if len(req.token_ids) > engine.max_context:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt of {len(req.token_ids)} tokens exceeds the model's context "
                          f"of {engine.max_context}")
            job = _Job(req, dict(req.trace_context))
            with self._qlock:
                self._queued_tokens += len(req.token_ids)
                self._queued_requests += 1
                self.m_queue.set(self._queued_tokens)
            self._jobs.put(job)
            try:
                return job.done.result()
            except InvalidArgument as e:
                self.m_requests.labels("invalid").inc()
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except StoreError as e:
                self.m_requests.labels("store_error").inc()
                ctx.abort(grpc.StatusCode.UNAVAILABLE, f"KV handoff failed: {e}")
            except Exception as e:
                self.m_requests.labels("error").inc()
                ctx.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(e).__name__}: {e}")
            raise AssertionError("unreachable")
        finally:
            self.release()

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.done.set_result(self._execute(job))
                self.m_requests.labels("ok").inc()
            except Exception as e:
                if not isinstance(e, MooncakeError):
                    log.exception("prefill failed", extra={"request_id": job.request.request_id})
                job.done.set_exception(e)
            finally:
                with self._qlock:
                    self._queued_tokens -= len(job.request.token_ids)
                    self._queued_requests -= 1
                    self.m_queue.set(self._queued_tokens)

    def _staging_views(self, n: int, size: int) -> list[memoryview]:
        """Views over one grow-only buffer: the engine copies imported KV out before returning,
        so a single prefill at a time can reuse it and never pays for fresh pages."""
        if self._staging.nbytes < n * size:
            self._staging = np.empty(n * size, dtype=np.uint8)
        mv = byte_view(self._staging, writable=True)
        return [mv[i * size:(i + 1) * size] for i in range(n)]

    def _execute(self, job: _Job) -> pb.PrefillResponse:
        assert self.engine is not None
        engine = self.engine
        req = job.request
        started = time.monotonic()
        tokens = list(req.token_ids)
        sampling = sampling_from_pb(req.sampling)
        with tracing.span("prefill", job.trace, request_id=req.request_id,
                          prompt_tokens=len(tokens)) as sp:
            keys = engine.block_keys(tokens, req.tenant)
            imported: list[memoryview] = []
            with tracing.span("prefill.load_kv"):
                if req.use_prefix_cache and keys:
                    imported = self._load_prefix(keys, engine.layout.block_bytes(
                        engine.block_tokens))
            loaded = time.monotonic()
            with tracing.span("prefill.compute", imported_blocks=len(imported)):
                res = engine.prefill(tokens, imported, sampling, seq_id=req.request_id)
            computed = time.monotonic()
            with tracing.span("prefill.store_kv", new_blocks=len(res.new_blocks)):
                stored, tkey = self._store(req, keys, res)
            done = time.monotonic()
            sp.set_attribute("cached_tokens", res.cached_tokens)
        self.m_blocks.labels("imported").inc(len(imported) - res.rejected_blocks)
        self.m_blocks.labels("rejected").inc(res.rejected_blocks)
        self.m_blocks.labels("stored").inc(stored)
        self.m_tokens.labels("cache").inc(res.cached_tokens)
        self.m_tokens.labels("computed").inc(res.computed_tokens)
        for phase, secs in (("queue", started - job.queued_at), ("load", loaded - started),
                            ("compute", computed - loaded), ("store", done - computed)):
            self.m_latency.labels(phase).observe(secs)
        return pb.PrefillResponse(
            first_token=res.first_token, text=res.text, finished=res.finished,
            finish_reason=res.finish_reason or "", prompt_tokens=len(tokens),
            cached_tokens=res.cached_tokens, computed_tokens=res.computed_tokens,
            tail_key=tkey, stored_blocks=stored, rejected_blocks=res.rejected_blocks,
            queue_ms=(started - job.queued_at) * 1e3, load_ms=(loaded - started) * 1e3,
            compute_ms=(computed - loaded) * 1e3, store_ms=(done - computed) * 1e3,
        )

    def _load_prefix(self, keys: list[str], block_bytes: int) -> list[memoryview]:
        """The leading cached blocks, read straight into staging memory (misses end it)."""
        try:
            n = self.store.prefix_len(keys)
            if not n:
                return []
            views = self._staging_views(n, block_bytes)
            sizes = self.store.batch_get_into(keys[:n], views)
        except StoreError as e:
            log.warning("prefix lookup failed; computing everything", extra={"error": str(e)})
            return []
        out: list[memoryview] = []
        for v, size in zip(views, sizes, strict=True):
            if size is None:
                break
            out.append(v[:size])
        return out

    def _store(self, req: pb.PrefillRequest, keys: list[str], res: Any) -> tuple[int, str]:
        """Publish the new blocks (and the tail, which decode needs) next to the decode engine.

        A block another prefill stored meanwhile (ObjectExists) is as good as ours: blocks with
        one key hold identical KV. Anything else means decode could not find the KV, so it fails
        the request rather than let decode stall.
        """
        placement = "preferred" if req.decode_segment else "local_first"
        items = [(keys[i], data) for i, data in res.new_blocks]
        tkey = ""
        if res.tail_block is not None and not res.finished:
            tkey = tail_key(req.request_id)
            items.append((tkey, res.tail_block))
        if not items:
            return 0, tkey
        errors = self.store.batch_put(
            [k for k, _ in items], [d for _, d in items], placement=placement,
            preferred_segment=req.decode_segment or None,
        )
        stored = 0
        for (key, _), err in zip(items, errors, strict=True):
            if err is None:
                stored += key != tkey
            elif not isinstance(err, ObjectExists):
                raise StoreError(f"storing block {key}: {err}") from err
        return stored, tkey


def run_prefill(config: WorkerConfig) -> None:
    run_worker(PrefillService(config))
