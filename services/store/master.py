"""The store master's gRPC shell around `MasterState`.

Every RPC of `service Master` (proto/store.proto) is a thin call into the state, with errors
mapped to gRPC status codes and a specific message; no exception escapes a handler. A background
thread runs `MasterState.tick` (expiry of nodes, puts, leases and copies; watermark eviction).

A restarted master first rebuilds its metadata from the nodes' inventories: until its known
nodes have re-registered (or a grace period passed) lookups and puts answer UNAVAILABLE with a
`mooncake-recovering` trailer, which clients retry (see `recovery`).

GetReplicas answers are serialized by the state itself (each object's replica list is encoded
once and cached), which is what keeps batched lookups above 100k keys/s on one core.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_k8s.common.errors import (
    InvalidArgument,
    NoSpace,
    ObjectTooLarge,
    StoreError,
)
from mooncake_k8s.common.metrics import LATENCY_BUCKETS, serve_metrics
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpcserver import start_server
from mooncake_k8s.store.metadata import MasterState, PutNotFound, PutSuperseded, UnknownNode
from mooncake_k8s.store.records import Lookup
from mooncake_k8s.store.recovery import NodeRoster, RecoveryGate

log = logging.getLogger(__name__)

SERVICE = "mooncake.store.v1.Master"
RECOVERING_KEY = "mooncake-recovering"
"""Trailing metadata on an UNAVAILABLE that the master sent on purpose while it rebuilds: the
call did nothing, so even a put may be retried."""
_TIER_NAMES: dict[int, str] = {pb.DRAM: "dram", pb.SSD: "ssd"}


@dataclass
class MasterConfig:
    """Settings of the master (flags / env vars of `mooncake store master`)."""

    host: str = "127.0.0.1"
    """Address to bind; exactly this one (never every interface by default)."""
    port: int = 50051
    """gRPC port; 0 picks a free one (see `MasterServer.port`)."""
    token: str = ""
    """Cluster token required on every RPC; empty disables the check."""
    metrics_port: int | None = None
    """Prometheus port on `metrics_host`; 0 picks a free one, None or -1 disables."""
    metrics_host: str | None = None
    """Defaults to `host`."""
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    put_timeout_s: float = 30.0
    """A put not ended within this time is revoked and its space reclaimed."""
    put_claim_s: float = 1.0
    """How long a pending put keeps other writers of its key away (plus time for its size): a
    crashed writer blocks its key this long, not for the whole put timeout."""
    state_dir: str | None = None
    """Where the master keeps the ids of its registered nodes, so that after a restart it knows
    whom to wait for. None: it cannot tell a first start from a restart and always waits for
    `recovery_grace_s`."""
    recovery_grace_s: float = 3.0
    """After a restart, answer UNAVAILABLE at most this long while nodes re-register (nodes
    re-register within about a heartbeat interval); 0 disables recovery."""
    lease_ms: int = 2000
    max_lease_ms: int = 60_000
    node_timeout_s: float = 10.0
    heartbeat_interval_ms: int = 1000
    max_object_size: int = 1 << 30
    tick_interval_s: float = 0.05
    workers: int = 64
    """gRPC worker threads; node command streams and watches each hold one."""
    event_queue: int = 10_000
    """Events buffered per Watch subscriber before it is disconnected as too slow."""


class _StateCollector(Collector):
    """Gauges and counters read from the state at scrape time."""

    def __init__(self, state: MasterState, gate: RecoveryGate) -> None:
        self._state = state
        self._gate = gate

    def collect(self) -> Iterator[Any]:
        c = self._state.counters()
        objects = GaugeMetricFamily("mooncake_store_objects", "Committed objects")
        objects.add_metric([], c["objects"])
        nodes = GaugeMetricFamily("mooncake_store_nodes", "Registered storage nodes")
        nodes.add_metric([], c["nodes"])
        pending = GaugeMetricFamily("mooncake_store_pending_puts", "Puts started, not ended")
        pending.add_metric([], c["pending_puts"])
        leases = GaugeMetricFamily("mooncake_store_leases", "Active read leases")
        leases.add_metric([], c["leases"])
        cap = GaugeMetricFamily(
            "mooncake_store_capacity_bytes", "Segment capacity", labels=["segment", "tier"]
        )
        used = GaugeMetricFamily(
            "mooncake_store_used_bytes", "Allocated bytes", labels=["segment", "tier"]
        )
        for name, tier, size, u in self._state.segment_usage():
            t = _TIER_NAMES.get(tier, "unknown")
            cap.add_metric([name, t], size)
            used.add_metric([name, t], u)
        lookups = CounterMetricFamily(
            "mooncake_store_lookups", "Keys looked up by result", labels=["result"]
        )
        lookups.add_metric(["hit"], c["hits"])
        lookups.add_metric(["miss"], c["misses"])
        ev = CounterMetricFamily("mooncake_store_evictions", "Replicas evicted for space")
        ev.add_metric([], c["evictions"])
        sp = CounterMetricFamily("mooncake_store_spills", "DRAM replicas moved to SSD")
        sp.add_metric([], c["spills"])
        pr = CounterMetricFamily("mooncake_store_promotions", "SSD objects copied back to DRAM")
        pr.add_metric([], c["promotions"])
        rec = GaugeMetricFamily(
            "mooncake_store_recovering", "1 while a restarted master rebuilds its metadata"
        )
        rec.add_metric([], 0 if self._gate.is_open else 1)
        yield from (objects, nodes, pending, leases, cap, used, lookups, ev, sp, pr, rec)


class _Abort(Exception):
    """Raised by a handler to end the call with this status."""

    def __init__(
        self, code: grpc.StatusCode, message: str,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = trailers


def _status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, _Abort):
        return e.code, e.message
    if isinstance(e, ObjectTooLarge):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, NoSpace):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, PutSuperseded):
        return grpc.StatusCode.ALREADY_EXISTS, str(e)
    if isinstance(e, PutNotFound | UnknownNode):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, StoreError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    return grpc.StatusCode.INTERNAL, "internal error in the master (see its log)"


def _serialize(msg: Any) -> bytes:
    if type(msg) is bytes:
        return msg
    return bytes(msg.SerializeToString())


class MasterServicer:
    """One method per RPC; each takes (request, context) like a generated servicer."""

    def __init__(
        self, state: MasterState, config: MasterConfig, stopping: threading.Event,
        gate: RecoveryGate,
    ) -> None:
        self.state = state
        self.config = config
        self._stopping = stopping
        self.gate = gate

    def _authoritative(self) -> None:
        """Refuse (UNAVAILABLE, retryable) while a restarted master is still rebuilding."""
        if not self.gate.is_open:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, self.gate.describe(),
                         ((RECOVERING_KEY, "1"),))

    # -- nodes -----------------------------------------------------------------------------

    def RegisterNode(self, req: pb.RegisterNodeRequest, ctx: Any) -> pb.RegisterNodeResponse:
        reg = self.state.register_node(
            req.node_id, req.address, req.host_id, list(req.segments), list(req.inventory),
            req.incarnation,
        )
        self.gate.registered(req.node_id)
        return pb.RegisterNodeResponse(
            master_id=self.state.master_id,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            restored_objects=reg.restored, dropped_replicas=reg.dropped,
        )

    def Heartbeat(self, req: pb.HeartbeatRequest, ctx: Any) -> pb.HeartbeatResponse:
        known = self.state.heartbeat(req.node_id)
        return pb.HeartbeatResponse(reregister=not known, master_id=self.state.master_id)

    def NodeCommands(self, req: pb.NodeCommandsRequest, ctx: Any) -> Iterator[pb.NodeCommand]:
        stream = self.state.open_command_stream(req.node_id, req.master_id)
        if stream is None:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {req.node_id!r} is not registered with this master; register again",
            )
        while not self._stopping.is_set() and ctx.is_active():
            cmds = self.state.next_commands(req.node_id, stream, 0.5)
            if cmds is None:
                return
            yield from cmds

    def CommandDone(self, req: pb.CommandDoneRequest, ctx: Any) -> pb.CommandDoneResponse:
        self.state.command_done(req.node_id, req.id, req.ok, req.error)
        return pb.CommandDoneResponse()

    # -- puts ------------------------------------------------------------------------------

    def PutStart(self, req: pb.PutStartRequest, ctx: Any) -> pb.PutStartResponse:
        self._authoritative()
        return self.state.put_start(
            req.key, req.size, req.replicas, req.placement, req.preferred_segment,
            req.client_host_id,
        )

    def PutEnd(self, req: pb.PutEndRequest, ctx: Any) -> pb.PutEndResponse:
        self.state.put_end(req.key, req.put_id, req.checksum)
        return pb.PutEndResponse()

    def PutRevoke(self, req: pb.PutRevokeRequest, ctx: Any) -> pb.PutRevokeResponse:
        self.state.put_revoke(req.key, req.put_id)
        return pb.PutRevokeResponse()

    def BatchPutStart(self, req: pb.BatchPutStartRequest, ctx: Any) -> pb.BatchPutStartResponse:
        self._authoritative()
        return pb.BatchPutStartResponse(results=self.state.batch_put_start(req.items))

    def BatchPutEnd(self, req: pb.BatchPutEndRequest, ctx: Any) -> pb.BatchPutEndResponse:
        return self.state.batch_put_end(req.items)

    # -- reads -----------------------------------------------------------------------------

    def GetReplicas(self, req: pb.GetReplicasRequest, ctx: Any) -> bytes:
        self._authoritative()
        lookup: Lookup = self.state.get_replicas(req.keys, req.lease_ms, req.client_host_id)
        return lookup.encode()

    def ReleaseLease(self, req: pb.ReleaseLeaseRequest, ctx: Any) -> pb.ReleaseLeaseResponse:
        self.state.release_lease(req.lease_id)
        return pb.ReleaseLeaseResponse()

    def Exists(self, req: pb.ExistsRequest, ctx: Any) -> pb.ExistsResponse:
        self._authoritative()
        present, prefix = self.state.exists(req.keys)
        return pb.ExistsResponse(exists=present, prefix_len=prefix)

    def Remove(self, req: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        self._authoritative()
        return pb.RemoveResponse(removed=self.state.remove(req.keys, req.force))

    def Pin(self, req: pb.PinRequest, ctx: Any) -> pb.PinResponse:
        self._authoritative()
        return pb.PinResponse(ok=self.state.pin(req.keys, req.pin))

    def Watch(self, req: pb.WatchRequest, ctx: Any) -> Iterator[pb.BlockEvent]:
        sub = self.state.subscribe(req.node_id, self.config.event_queue)
        try:
            while not self._stopping.is_set() and ctx.is_active():
                events = sub.get(0.5)
                if events is None:
                    if sub.overflowed:
                        raise _Abort(
                            grpc.StatusCode.ABORTED,
                            "watch queue overflowed (subscriber too slow); resubscribe",
                        )
                    return
                yield from events
        finally:
            sub.close()

    def Stats(self, req: pb.StatsRequest, ctx: Any) -> pb.StatsResponse:
        stats = self.state.stats()
        stats.recovering = not self.gate.is_open
        return stats


_UNARY: tuple[tuple[str, Any], ...] = (
    ("RegisterNode", pb.RegisterNodeRequest),
    ("Heartbeat", pb.HeartbeatRequest),
    ("CommandDone", pb.CommandDoneRequest),
    ("PutStart", pb.PutStartRequest),
    ("PutEnd", pb.PutEndRequest),
    ("PutRevoke", pb.PutRevokeRequest),
    ("BatchPutStart", pb.BatchPutStartRequest),
    ("BatchPutEnd", pb.BatchPutEndRequest),
    ("GetReplicas", pb.GetReplicasRequest),
    ("ReleaseLease", pb.ReleaseLeaseRequest),
    ("Exists", pb.ExistsRequest),
    ("Remove", pb.RemoveRequest),
    ("Pin", pb.PinRequest),
    ("Stats", pb.StatsRequest),
)
_STREAM: tuple[tuple[str, Any], ...] = (
    ("NodeCommands", pb.NodeCommandsRequest),
    ("Watch", pb.WatchRequest),
)


class MasterServer:
    """The master process: gRPC server, tick thread, optional /metrics."""

    def __init__(self, config: MasterConfig, state: MasterState | None = None) -> None:
        self.config = config
        self.state = state or MasterState(
            high_watermark=config.high_watermark, low_watermark=config.low_watermark,
            put_timeout_s=config.put_timeout_s, put_claim_s=config.put_claim_s,
            lease_ms=config.lease_ms,
            max_lease_ms=max(config.max_lease_ms, config.lease_ms),
            node_timeout_s=config.node_timeout_s, max_object_size=config.max_object_size,
            event_queue=config.event_queue,
        )
        self.roster = NodeRoster(config.state_dir) if config.state_dir else None
        expected = self.roster.load() if self.roster else None
        self.gate = RecoveryGate(expected, config.recovery_grace_s)
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(self.state, self.gate))
        self._rpc_seconds = Histogram(
            "mooncake_master_rpc_seconds", "Master RPC latency", ["method"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._stopping = threading.Event()
        self._servicer = MasterServicer(self.state, config, self._stopping, self.gate)
        self._server: grpc.Server | None = None
        self._ticker: threading.Thread | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def master_id(self) -> str:
        return self.state.master_id

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # -- handlers --------------------------------------------------------------------------

    def _unary(self, name: str) -> Callable[[Any, Any], Any]:
        method = getattr(self._servicer, name)
        timer = self._rpc_seconds.labels(name)

        def handler(req: Any, ctx: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(req, ctx)
            except Exception as e:  # mapped to a status; nothing kills the server
                code, msg = _status_of(e)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("rpc failed", extra={"method": name})
                if isinstance(e, _Abort) and e.trailers:
                    ctx.set_trailing_metadata(e.trailers)
                err = (code, msg)
            finally:
                timer.observe(time.perf_counter() - start)
            ctx.abort(err[0], err[1])

        return handler

    def _stream(self, name: str) -> Callable[[Any, Any], Iterator[Any]]:
        method = getattr(self._servicer, name)

        def handler(req: Any, ctx: Any) -> Iterator[Any]:
            try:
                yield from method(req, ctx)
                return
            except Exception as e:
                code, msg = _status_of(e)
                if code == grpc.StatusCode.INTERNAL:
                    if ctx.is_active() and not self._stopping.is_set():
                        log.exception("stream failed", extra={"method": name})
                    else:
                        return
                err = (code, msg)
            ctx.abort(err[0], err[1])

        return handler

    def _generic_handler(self) -> Any:
        handlers: dict[str, Any] = {}
        for name, req_type in _UNARY:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary(name), request_deserializer=req_type.FromString,
                response_serializer=_serialize,
            )
        for name, req_type in _STREAM:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                self._stream(name), request_deserializer=req_type.FromString,
                response_serializer=_serialize,
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        server, self.port = start_server(
            "master", cfg.host, cfg.port, cfg.token, cfg.workers, self._generic_handler()
        )
        self._server = server
        self._ticker = threading.Thread(target=self._tick_loop, name="master-tick", daemon=True)
        self._ticker.start()
        if cfg.metrics_port is not None and cfg.metrics_port >= 0:
            self.metrics_port = serve_metrics(
                self.registry, cfg.metrics_host or cfg.host, cfg.metrics_port
            )

    def _tick_loop(self) -> None:
        roster_ok = True
        while not self._stopping.wait(self.config.tick_interval_s):
            try:
                self.state.tick()
            except Exception:
                log.exception("master tick failed")
            # The roster is what a restarted master waits for; while rebuilding, the roster
            # on disk still names the nodes not back yet, so it is kept until the gate opens.
            if self.roster is not None and self.gate.is_open:
                try:
                    self.roster.save(self.state.node_ids())
                    roster_ok = True
                except OSError as e:
                    if roster_ok:  # once per failure streak, not every tick
                        log.error("cannot save the node roster: %s", e,
                                  extra={"path": str(self.roster.path)})
                    roster_ok = False

    def stop(self, grace: float = 1.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.state.close()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._ticker is not None:
            self._ticker.join(timeout=5)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or `timeout` passes (False)."""
        if self._server is None:
            return True
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> MasterServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def run_master(config: MasterConfig) -> None:
    """Start the master and block until SIGTERM/SIGINT, then stop cleanly."""
    server = MasterServer(config)
    done = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    log.info(
        "store master listening",
        extra={"address": server.address, "master_id": server.master_id,
               "metrics_port": server.metrics_port, "auth": bool(config.token)},
    )
    try:
        while not done.wait(0.5):
            pass
    finally:
        server.stop()
        log.info("store master stopped", extra={"master_id": server.master_id})
