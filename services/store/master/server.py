"""The store master process: the gRPC server around `MasterState`, its tick thread, /metrics.

The RPC handlers are in `servicer`, served by `grpc.aio` on an event loop of its own thread, so
that the long-lived streams (each node's command stream, each Watch subscriber) cost no thread;
unary calls go on being answered however many streams are open. A background thread runs
`MasterState.tick` (expiry of nodes, puts, leases and copies; watermark eviction).

A restarted master first rebuilds its metadata from the nodes' inventories: until its known
nodes have re-registered (or a grace period passed) lookups and puts answer UNAVAILABLE with a
`mooncake-recovering` trailer, which clients retry (see `recovery`).

GetReplicas answers are serialized by the state itself (each object's replica list is encoded
once and cached), which is what keeps batched lookups above 100k keys/s on one core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncake_k8s.common.metrics import LATENCY_BUCKETS, serve_metrics
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpcserver import MAX_MESSAGE
from mooncake_k8s.store.master.config import MasterConfig
from mooncake_k8s.store.master.fanout import FanoutSettings
from mooncake_k8s.store.master.fastpath import FastPathServer
from mooncake_k8s.store.master.ha import RedisCoordinator
from mooncake_k8s.store.master.quotas import Quota, tenant_metrics
from mooncake_k8s.store.master.recovery import NodeRoster, RecoveryGate
from mooncake_k8s.store.master.servicer import Handlers, MasterServicer
from mooncake_k8s.store.master.state import MasterState

__all__ = ["MasterConfig", "MasterServer", "run_master"]

log = logging.getLogger(__name__)

_TIER_NAMES: dict[int, str] = {pb.DRAM: "dram", pb.SSD: "ssd"}


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
        fan = CounterMetricFamily("mooncake_store_fanout_replicas",
                                  "Fan-out replicas of hot objects, by what happened",
                                  labels=["event"])
        fan.add_metric(["added"], c["fanout_added"])
        fan.add_metric(["dropped"], c["fanout_dropped"])
        hot = GaugeMetricFamily("mooncake_store_fanout_hot_objects",
                                "Objects read past the fan-out threshold (this or last window)")
        hot.add_metric([], c["fanout_hot"])
        extra = GaugeMetricFamily("mooncake_store_fanout_extra_replicas",
                                  "Fan-out replicas held now")
        extra.add_metric([], c["fanout_extra"])
        yield from (objects, nodes, pending, leases, cap, used, lookups, ev, sp, pr, rec, fan,
                    hot, extra)
        yield from tenant_metrics(self._state.tenant_report())


class MasterServer:
    """The master process: gRPC server (grpc.aio on its own loop thread), tick thread, optional
    /metrics. `start`/`stop` are called from ordinary threads."""

    def __init__(self, config: MasterConfig, state: MasterState | None = None) -> None:
        self.config = config
        self.state = state or MasterState(
            high_watermark=config.high_watermark, low_watermark=config.low_watermark,
            put_timeout_s=config.put_timeout_s, put_claim_s=config.put_claim_s,
            lease_ms=config.lease_ms,
            max_lease_ms=max(config.max_lease_ms, config.lease_ms),
            node_timeout_s=config.node_timeout_s, max_object_size=config.max_object_size,
            event_queue=config.event_queue,
            fanout=FanoutSettings(config.fanout, config.fanout_threshold,
                                  config.fanout_window_s, config.fanout_max_replicas),
            tenant_quotas={t: Quota(d, s) for t, (d, s) in config.tenant_quotas.items()},
        )
        if config.metadata_backend not in ("embedded", "redis"):
            raise ValueError(f"metadata backend must be embedded or redis, not "
                             f"{config.metadata_backend!r}")
        if config.metadata_backend == "redis" and not config.redis_url:
            raise ValueError("the redis metadata backend needs a Redis URL (--redis-url)")
        self.ha: RedisCoordinator | None = None
        self.roster = NodeRoster(config.state_dir) if config.state_dir else None
        if config.metadata_backend == "redis":
            self.roster = None  # the roster lives in Redis
            expected: frozenset[str] | None = None
            grace = 1e9  # a standby's gate: opened by a new gate when it is promoted
        else:
            expected = self.roster.load() if self.roster else None
            grace = config.recovery_grace_s
        self.gate = RecoveryGate(expected, grace)
        self._ha_roster: frozenset[str] = frozenset()
        self.exit_code = 0
        self.registry = CollectorRegistry()
        self._collector = _StateCollector(self.state, self.gate)
        self.registry.register(self._collector)
        self._rpc_seconds = Histogram(
            "mooncake_master_rpc_seconds", "Master RPC latency", ["method"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._leader = Gauge("mooncake_master_leader",
                             "1 while this master leads (always 1 without HA)",
                             registry=self.registry)
        self._leader.set(0 if config.metadata_backend == "redis" else 1)
        self._epoch = Gauge("mooncake_master_epoch", "Fencing token of this master's leadership",
                            registry=self.registry)
        self._servicer = MasterServicer(self.state, config, self._stopping, self.gate)
        self._handlers: Handlers | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._fast: FastPathServer | None = None
        self.fast_port: int | None = None
        self._ticker: threading.Thread | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def master_id(self) -> str:
        return self.state.master_id

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Bind and serve; raises OSError (naming the address) when the port is taken."""
        cfg = self.config
        loop = asyncio.new_event_loop()
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max(1, cfg.workers), "master-exec")
        )
        thread = threading.Thread(target=loop.run_forever, name="master-loop", daemon=True)
        thread.start()
        self._loop, self._loop_thread = loop, thread
        try:
            if cfg.metadata_backend == "redis":
                # The port must be known before the coordinator advertises it: bind first
                # (every call is refused as a standby's until the lease is won).
                self.ha = self._servicer.ha = RedisCoordinator(
                    cfg.redis_url, "", prefix=cfg.ha_prefix, lease_ms=cfg.ha_lease_ms,
                    journal_keep_s=cfg.journal_keep_s, master_id=self.state.master_id,
                    on_promoted=self._promoted, on_deposed=self._deposed,
                )
            self._handlers = Handlers(
                self._servicer, cfg.token, self._rpc_seconds, self._stopping)
            self.port = asyncio.run_coroutine_threadsafe(self._serve(), loop).result(timeout=60)
        except BaseException:
            self._close_loop()
            raise
        if self.ha is not None:
            self.ha.address = cfg.advertise or self.address
            self.ha.start()
            log.info("store master waiting for the leader lease",
                     extra={"redis": self.ha.location, "advertise": self.ha.address})
        self._ticker = threading.Thread(target=self._tick_loop, name="master-tick", daemon=True)
        self._ticker.start()
        if cfg.metrics_port is not None and cfg.metrics_port >= 0:
            self.metrics_port = serve_metrics(
                self.registry, cfg.metrics_host or cfg.host, cfg.metrics_port
            )

    async def _serve(self) -> int:
        cfg = self.config
        server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a second master can never silently share the port
            # Calls that arrived but wait for the loop to pick them up; beyond gRPC's default
            # (1,000) they are CANCELLED, which a thousand nodes reconnecting at once reach.
            ("grpc.server.max_pending_requests", 1 << 16),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ])
        assert self._handlers is not None
        server.add_generic_rpc_handlers((self._handlers.generic_handler(),))
        target = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError as e:
            raise OSError(f"cannot bind the master server to {target}: {e}") from e
        if not bound:
            raise OSError(f"cannot bind the master server to {target}")
        await server.start()
        self._server = server
        if cfg.fast_port >= 0:
            self._fast = FastPathServer(self._handlers, cfg.token)
            try:
                self.fast_port = await self._fast.start(cfg.host, cfg.fast_port)
            except OSError as e:
                await server.stop(None)
                raise OSError(f"cannot bind the master's fast path to {cfg.host}:"
                              f"{cfg.fast_port}: {e}") from e
            self._handlers.advertise_fast_port(self.fast_port)
        return int(bound)

    # -- HA (Redis) ----------------------------------------------------------------------

    def _promoted(self, epoch: int) -> None:
        """Won the lease: rebuild from the nodes like a restarted master, waiting for the
        roster the last leader kept in Redis."""
        assert self.ha is not None
        roster = self.ha.load_roster()
        self._ha_roster = roster
        self._servicer.pins = set(self.ha.load_pins())
        self.gate = self._servicer.gate = self._collector._gate = RecoveryGate(
            roster, self.config.recovery_grace_s)
        self._leader.set(1)
        self._epoch.set(epoch)
        log.info("leading: rebuilding the metadata from the storage nodes",
                 extra={"epoch": epoch, "known_nodes": len(roster),
                        "pins": len(self._servicer.pins)})

    def _deposed(self, reason: str) -> None:
        """Lost the lease: this process's metadata may be stale, so it must never lead
        again; it stops and exits (status 3) and its supervisor starts a clean standby."""
        self._leader.set(0)
        self.exit_code = 3
        threading.Thread(target=self.stop, name="master-deposed", daemon=True).start()

    def _ha_tick(self, last_trim: float) -> float:
        ha = self.ha
        if ha is None or not ha.is_leader or not self.gate.is_open:
            return last_trim
        ids = frozenset(self.state.node_ids())
        if ids != self._ha_roster:
            ha.save_roster(ids, self._ha_roster)
            self._ha_roster = ids
        now = time.monotonic()
        if now - last_trim >= 5.0:
            ha.trim_journal(ids)
            return now
        return last_trim

    def _tick_loop(self) -> None:
        roster_ok = True
        last_trim = 0.0
        while not self._stopping.wait(self.config.tick_interval_s):
            try:
                self.state.tick()
            except Exception:
                log.exception("master tick failed")
            try:
                last_trim = self._ha_tick(last_trim)
            except Exception as e:  # Redis trouble: the election thread decides what it means
                log.warning("cannot update the roster or journal in redis",
                            extra={"error": type(e).__name__})
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
        if self.ha is not None:
            self.ha.stop(resign=not self.ha.deposed.is_set())
        self.state.close()  # wakes every stream: they end on their own
        loop, server = self._loop, self._server
        if loop is not None and self._fast is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(self._fast.stop(), loop).result(5)
        if loop is not None and server is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace), loop).result(grace + 10)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.warning("master server did not stop within its grace period")
        self._close_loop()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        self._stopped.set()

    def _close_loop(self) -> None:
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        self._loop = self._loop_thread = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or `timeout` passes (False)."""
        if self._server is None:
            return True
        return self._stopped.wait(timeout)

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
               "fast_port": server.fast_port,
               "metrics_port": server.metrics_port, "auth": bool(config.token)},
    )
    try:
        while not done.wait(0.2):
            if server.wait(0):  # stopped on its own (deposed)
                break
    finally:
        server.stop()
        log.info("store master stopped", extra={"master_id": server.master_id})
    if server.exit_code:
        raise SystemExit(server.exit_code)
