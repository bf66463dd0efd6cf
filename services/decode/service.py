"""The decode service: load a request's KV from the store, join the running batch, stream tokens.

One engine thread owns the engine and runs the continuous-batching loop: between steps it takes
in newly loaded sequences and drops cancelled ones, then advances every running sequence by one
token in one forward pass. gRPC threads do the slow part of admission (reading the KV blocks
from the store) outside that loop, so a long prompt arriving never stalls everyone's next token.

With `local_segment_size` the decode process also serves a DRAM segment to the store (like a
storage node living beside the engine); prefill writes a request's blocks there, so the KV this
instance reads is usually a local shared-memory copy.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from mooncake_k8s.common import tracing
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import MooncakeError, StoreError
from mooncake_k8s.common.metrics import LATENCY_BUCKETS
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.worker import Worker, WorkerConfig, run_worker, sampling_from_pb

log = logging.getLogger(__name__)

SERVICE = "mooncake.serving.v1.Decode"


@dataclass
class _Seq:
    request: pb.DecodeRequest
    blocks: list[memoryview]
    sampling: Any
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    added_at: float = field(default_factory=time.monotonic)


class DecodeService(Worker):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._inbox: queue.SimpleQueue[_Seq] = queue.SimpleQueue()
        self._waiting: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop_loop = threading.Event()
        self._node: Any = None
        self.local_segment = ""
        r = self.registry
        self.m_requests = Counter("mooncake_decode_requests_total", "Decode requests",
                                  ["result"], registry=r)
        self.m_tokens = Counter("mooncake_decode_tokens_total", "Tokens generated", registry=r)
        self.m_kv_bytes = Counter("mooncake_decode_kv_bytes_total",
                                  "KV bytes loaded from the store", registry=r)
        self.m_step = Histogram("mooncake_decode_step_seconds", "One batched decode step",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.m_load = Histogram("mooncake_decode_kv_load_seconds", "KV load per request",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.m_running = Gauge("mooncake_decode_running", "Sequences in the batch", registry=r)

    def start(self) -> None:
        cfg = self.config
        if cfg.local_segment_size > 0:
            from mooncake_k8s.store.node import NodeConfig, StorageNode

            node_id = f"decode-{cfg.instance_id}"
            self._node = StorageNode(NodeConfig(
                master=cfg.master, node_id=node_id, token=cfg.token, host=cfg.host,
                advertise_host=cfg.advertise_host, dram_size=cfg.local_segment_size,
            ))
            self._node.start()
            self.local_segment = f"{node_id}-dram-0"
        super().start()

    def not_ready(self) -> str | None:
        reason = super().not_ready()
        if reason is None and self._node is not None and not self._node.wait_registered(0):
            return "local segment not registered with the store master"
        return reason

    def on_engine_loaded(self, engine: Any) -> None:
        threading.Thread(target=self._loop, name="decode-engine", daemon=True).start()

    def handlers(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Decode": grpc.unary_stream_rpc_method_handler(
                self.decode, request_deserializer=pb.DecodeRequest.FromString,
                response_serializer=pb.DecodeChunk.SerializeToString),
            "Load": self.load_handler(self.report),
        })

    def report(self) -> pb.LoadReport:
        rep = self.load_report()
        rep.local_segment = self.local_segment
        if self.engine is not None:
            load = self.engine.load()
            rep.running = load["running"] + len(self._waiting)
            rep.kv_free_tokens = load["kv_free_tokens"]
            rep.kv_capacity_tokens = load["kv_capacity_tokens"]
        return rep

    def stop(self) -> None:
        self._stop_loop.set()
        self._wake.set()
        super().stop()
        if self._node is not None:
            self._node.stop()

    # -- the RPC ---------------------------------------------------------------------------

    def decode(self, req: pb.DecodeRequest, ctx: grpc.ServicerContext) -> Iterator[pb.DecodeChunk]:
        engine = self.admit(ctx)
        rid = req.request_id
        try:
            with tracing.span("decode.load_kv", dict(req.trace_context), request_id=rid):
                t0 = time.monotonic()
                blocks = self._load_kv(engine, req, ctx)
                self.m_load.observe(time.monotonic() - t0)
            seq = _Seq(req, blocks, sampling_from_pb(req.sampling))
            ctx.add_callback(lambda: self._aborts.put(rid))
            self._inbox.put(seq)
            self._wake.set()
            while True:
                item = seq.out.get()
                if isinstance(item, BaseException):
                    self.m_requests.labels("error").inc()
                    code = (grpc.StatusCode.RESOURCE_EXHAUSTED if "full" in str(item).lower()
                            else grpc.StatusCode.INTERNAL)
                    ctx.abort(code, f"decode failed: {item}")
                self.m_tokens.inc()
                yield pb.DecodeChunk(token_id=item.token_id, text=item.text,
                                     finished=item.finished, finish_reason=item.finish_reason or "")
                if item.finished:
                    self.m_requests.labels("ok").inc()
                    return
        finally:
            self.release()

    def _load_kv(self, engine: Any, req: pb.DecodeRequest, ctx: grpc.ServicerContext
                 ) -> list[memoryview]:
        """Every prompt block plus the tail; a missing one fails the request (the Conductor
        retries it from prefill), since decode cannot recompute."""
        keys = engine.block_keys(list(req.token_ids), req.tenant)
        if req.tail_key:
            keys.append(req.tail_key)
        size = engine.layout.block_bytes(engine.block_tokens)
        buf = np.empty(len(keys) * size, dtype=np.uint8)
        mv = byte_view(buf, writable=True)
        views = [mv[i * size:(i + 1) * size] for i in range(len(keys))]
        try:
            got = self.store.batch_get_into(keys, views)
        except StoreError as e:
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"KV load failed: {e}")
        missing = [k for k, n in zip(keys, got, strict=True) if n is None]
        if missing:
            self.m_requests.labels("kv_missing").inc()
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{len(missing)} of {len(keys)} KV blocks missing from the store "
                      f"(first: {missing[0]})")
        if req.tail_key:
            with contextlib.suppress(StoreError):
                self.store.remove([req.tail_key], force=True)
        self.m_kv_bytes.inc(sum(n or 0 for n in got))
        return [v[:n] for v, n in zip(views, got, strict=True) if n is not None]

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        assert self.engine is not None
        engine = self.engine
        while not self._stop_loop.is_set():
            self._admit_new(engine)
            while not self._aborts.empty():
                rid = self._aborts.get()
                if rid in self._running:
                    engine.abort(rid)
                    del self._running[rid]
                self._waiting = [s for s in self._waiting if s.request.request_id != rid]
            self.m_running.set(len(self._running))
            if not self._running:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                outs = engine.step()
            except Exception as e:
                log.exception("decode step failed; failing the batch")
                for rid, seq in list(self._running.items()):
                    seq.out.put(e)
                    with contextlib.suppress(Exception):
                        engine.abort(rid)
                self._running.clear()
                continue
            self.m_step.observe(time.monotonic() - t0)
            for o in outs:
                target = self._running.get(o.seq_id)
                if target is None:
                    continue
                target.out.put(o)
                if o.finished:
                    del self._running[o.seq_id]

    def _admit_new(self, engine: Any) -> None:
        from mooncake_k8s.engine import EngineFull

        while not self._inbox.empty():
            self._waiting.append(self._inbox.get())
        still: list[_Seq] = []
        for seq in self._waiting:
            req = seq.request
            try:
                engine.add_sequence(req.request_id, list(req.token_ids), seq.blocks,
                                    req.first_token, seq.sampling)
            except EngineFull:
                still.append(seq)  # joins when a running sequence finishes
                continue
            except Exception as e:  # a bad sequence fails alone; the loop goes on
                if not isinstance(e, MooncakeError):
                    log.exception("adding a sequence failed", extra={"request_id": req.request_id})
                seq.out.put(e)
                continue
            seq.blocks = []  # the engine copied the KV; let the staging memory go
            self._running[req.request_id] = seq
        self._waiting = still


def run_decode(config: WorkerConfig) -> None:
    run_worker(DecodeService(config))
