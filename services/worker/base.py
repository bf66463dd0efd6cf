"""What the prefill and decode workers share: config, engine start-up, gRPC and health servers,
load reports, graceful drain, and the DRAM segment a worker serves to the store on its host.
The engine itself sits behind the engine seam (`engine.api`), of the kind the registry
(`engine.registry`) names; the worker imports nothing else of it.

With `local_segment_size` a worker (prefill or decode) also serves a DRAM segment of the pool
from its own process, like a storage node living beside the engine: decode's is where prefill
writes a request's blocks (the plan's `write_segment`), prefill's is where it keeps what it
computed (the plan's `home_segment`), so a repeat on this host reads shared memory instead of
crossing the network. Both report it (`LoadReport.local_segment`) with the host id that tells
the Conductor which other segments share the host (`LoadReport.host_id`).

Drain (SIGTERM, `--drain-timeout`): the worker turns draining at once (readiness false, the
load report says so, new calls get UNAVAILABLE), then works off what it holds within the grace
(`Worker.drain`). Prefill finishes its queue; prompts still in flight at the grace's end (less
a margin) end UNAVAILABLE, which the Conductor retries elsewhere. Decode with an engine that
can hand a stream over (`HandoffEngine`, the embedded one) lets a stream finish when its
remaining tokens x the recent step time fit in the grace left (with a safety factor and the
margin) and hands every other one over through the pool at once; at the grace's end less the
margin, anything left is handed over. Other engines' streams run until the grace ends and are
then cut (the Conductor resumes them by re-prefilling: the failover path).

The engine loads in the background so `/healthz` answers at once and `/readyz` turns 200 only
when the model is in memory; a pod is never routed to before it can serve. On SIGTERM a worker
stops taking new requests (readiness fails, new calls get UNAVAILABLE), drains (below), then
exits.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic

import grpc
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily
from typing_extensions import TypeVar

from mooncake_k8s.common.errors import StoreError
from mooncake_k8s.common.health import HealthServer, Watchdog, injected_hang, stop_requested
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpcserver import start_server
from mooncake_k8s.engine.api import (
    DecodeEngine,
    Engine,
    EngineContext,
    EngineInfo,
    EngineKind,
    EngineSettings,
    HandoffEngine,
    ModelConfig,
    PrefillEngine,
    Role,
    StreamState,
)
from mooncake_k8s.engine.registry import engine_kind
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.transfer.rdma import RdmaInfoCollector
from mooncake_k8s.worker.gie_metrics import GieMetrics

if TYPE_CHECKING:
    from mooncake_k8s.store.local import LocalSegment

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """Settings shared by `mooncake prefill` and `mooncake decode` (flags / env vars)."""

    role: str
    master: str
    engine: ModelConfig
    """The model (the embedded engine takes its own `EngineConfig` here, settings included)."""
    token: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    metrics_host: str | None = None
    metrics_port: int | None = 0
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    revision: str = ""
    workers: int = 32
    drain_timeout_s: float = 30.0
    local_segment_size: int = 0
    """Bytes of DRAM this worker serves to the store on its host (0 = none)."""
    transport: str = "auto"
    engine_kind: str = "embedded"
    """A name in `engine.registry`."""
    engine_settings: EngineSettings | None = None
    """The kind's own settings (`EngineKind.settings`); None = the kind's defaults."""
    stall_timeout_s: float = 300.0
    """Liveness: /healthz fails once a call into the engine has waited this long while nothing
    else the engine serves moved (a hung engine), so the kubelet restarts the pod."""
    pipeline_group: str = ""
    """The prefill group this worker is a stage of ("" = a single instance)."""
    pipeline_group_size: int = 1
    pipeline_stage: int = 0
    """0 = the group's leader (the only stage taking Prefill calls)."""
    pipeline_next: str = ""
    """The next stage's gRPC address ("" on the last stage; `{index}` already resolved)."""
    pipeline_chunk_tokens: int = 1024
    """The largest pipeline chunk in tokens (a multiple of the engine's prefill chunk)."""
    pipeline_chunks: int = 8
    """Pipeline chunks a prompt is cut into, each at most `pipeline_chunk_tokens` (0 = every
    chunk `pipeline_chunk_tokens` long): `prefill.pipeline.config.chunk_tokens_for`."""
    pipeline_stage_timeout_s: float = 10.0
    """The longest any wait on another stage may take before the prompt fails UNAVAILABLE."""

    @property
    def pipelined(self) -> bool:
        """A stage of a group of more than one (else a single instance)."""
        return self.pipeline_group_size > 1


E = TypeVar("E", bound=Engine, default=Engine)
"""The role's engine protocol (`Worker` alone: any engine, as a test that loads none has it)."""
R = TypeVar("R")
T = TypeVar("T")
_END = object()

HANDOFF_SAFETY = 1.5
"""A stream may finish during a drain when its remaining tokens x the step time x this fit."""


def hand_off_now(stream: StreamState, step_s: float, left_s: float) -> bool:
    """Whether a draining decode hands `stream` over now rather than let it finish: it is not
    in the batch, or its remaining tokens x the step time (x `HANDOFF_SAFETY`) do not fit in
    the `left_s` seconds of grace left before the margin."""
    if left_s <= 0 or not stream.running:
        return True
    return stream.remaining * step_s * HANDOFF_SAFETY > left_s


def drain_margin(grace: float) -> float:
    """The end of a grace kept for handing over (decode) or failing (prefill) what is left:
    a tenth of it, at least 0.5 s, at most half of it."""
    return min(max(0.5, 0.1 * grace), grace / 2)


class Worker(Generic[E]):
    """Base of the prefill and decode services: everything except the request handling."""

    role = "worker"

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.engine: E | None = None
        """The role's engine (`engine.api`) once loaded."""
        self.engine_error: str | None = None
        self.store = StoreClient(config.master, config.token, transport=config.transport)
        self.draining = threading.Event()
        self._inflight = 0
        self._inflight_lock = threading.Condition()
        self.watchdog = Watchdog(config.stall_timeout_s)
        self._server: grpc.Server | None = None
        self._health: HealthServer | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._segment: LocalSegment | None = None
        self.local_segment = ""
        """The pool segment this worker serves ("" = none): its name once started."""
        self._ready_gauge = Gauge(
            "mooncake_worker_ready", "1 when the worker serves requests", ["role"],
            registry=self.registry,
        )
        self.registry.register(_EngineCounters(lambda: self.engine))
        self.registry.register(_KeepCounters(self.store))
        # mooncake_transfer_rdma_info: whether RDMA is unavailable, untested or in use here.
        self.registry.register(RdmaInfoCollector(lambda: str(self.store.engine.transport)))
        self.registry.register(GieMetrics(lambda: getattr(self, "report", self.load_report)()))

    # -- lifecycle -------------------------------------------------------------------------

    def handlers(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        raise NotImplementedError

    def open_engine(self, kind: type[EngineKind], ctx: EngineContext) -> E:
        """The role's engine of `kind` (`PrefillWorker`, `DecodeWorker`)."""
        raise NotImplementedError

    def engine_context(self) -> EngineContext:
        """What the engine gets from this worker: the model, the kind's settings, the store."""
        cfg = self.config
        settings = cfg.engine_settings or engine_kind(cfg.engine_kind).settings({})
        role: Role = "prefill" if self.role == "prefill" else "decode"
        return EngineContext(
            role=role, model=cfg.engine,
            settings=settings, store=self.store, master=cfg.master, token=cfg.token,
            host=cfg.host, advertise_host=cfg.advertise_host or "", transport=cfg.transport)

    def on_engine_loaded(self, engine: E) -> None:
        """Hook for subclasses, called before the worker turns ready."""

    def start(self) -> None:
        cfg = self.config
        server, self.port = start_server(
            self.role, cfg.host, cfg.port, cfg.token, cfg.workers, self.handlers()
        )
        self._server = server
        try:
            self._start_segment()
        except BaseException:
            server.stop(None)  # the process is about to exit: let nothing keep it serving
            raise
        if cfg.metrics_port is not None and cfg.metrics_port >= 0:
            self._health = HealthServer(
                self.registry, cfg.metrics_host or cfg.host, cfg.metrics_port, self.not_ready,
                alive=self.watchdog.stalled,
            ).start()
            self.metrics_port = self._health.port
        threading.Thread(target=self._load_engine, name="engine-load", daemon=True).start()

    def _start_segment(self) -> None:
        """Serve the worker's DRAM segment (after the gRPC port is bound: a bad --host is
        refused there first, and the port names the segment)."""
        cfg = self.config
        if cfg.local_segment_size <= 0:
            return
        from mooncake_k8s.store.local import LocalSegment, LocalSegmentConfig

        # The node id is unique in the cluster (role and instance) and stable across restarts
        # of the instance (no pid, no port): a restarted worker takes over the shared-memory
        # file its killed predecessor left instead of leaving it beside a new one. Two clusters
        # on one host, both with a "decode-0", keep apart: their files are tagged by master.
        node_id = f"{self.role}-{cfg.instance_id}"
        self._segment = LocalSegment(LocalSegmentConfig(
            master=cfg.master, owner_id=node_id, size=cfg.local_segment_size,
            token=cfg.token, host=cfg.host, advertise_host=cfg.advertise_host,
        ))
        self._segment.start()
        self.local_segment = self._segment.name

    @property
    def host_id(self) -> str:
        """This host's shared-memory domain as the store sees it: the id the transfer engine
        and the local segment register with, so the Conductor can tell which segments live on
        this worker's host."""
        return self.store.engine.host_id

    def _load_engine(self) -> None:
        t0 = time.monotonic()
        try:
            engine = self.open_engine(engine_kind(self.config.engine_kind),
                                      self.engine_context())
            self.on_engine_loaded(engine)
        except Exception as e:
            self.engine_error = f"{type(e).__name__}: {e}"
            log.exception("engine failed to load")
            return
        if self.draining.is_set():  # stopped while loading: nothing may keep the engine alive
            engine.close()
            return
        self.engine = engine
        self._ready_gauge.labels(self.role).set(1)
        log.info(
            f"{self.role} ready",
            extra={"model": engine.info.served_name, "engine": engine.info.kind,
                   "seconds": round(time.monotonic() - t0, 2), "address": self.address,
                   "metrics_port": self.metrics_port},
        )

    def not_ready(self) -> str | None:
        """Why the worker is not ready (None: ready): the engine's state, then its segment."""
        reason = self.engine_state()
        if reason is None and self._segment is not None and not self._segment.registered():
            return "local segment not registered with the store master"
        return reason

    def engine_state(self) -> str | None:
        """Why the engine cannot take a request (None: it can)."""
        if self.engine_error:
            return f"engine failed: {self.engine_error}"
        if self.engine is None:
            return "loading the model"
        failed = self.engine.failure()
        if failed:
            return f"engine failed: {failed}"
        if self.draining.is_set():
            return "draining"
        return None

    @property
    def address(self) -> str:
        host = self.config.advertise_host or self.config.host
        return f"{host}:{self.port}"

    def drain_and_stop(self) -> None:
        """Refuse new work, drain what is held within the grace (`drain`), then stop."""
        self.draining.set()
        self._ready_gauge.labels(self.role).set(0)
        self.drain(time.monotonic() + self.config.drain_timeout_s)
        left = self.inflight()
        if left:
            log.warning("drain timed out", extra={"inflight": left})
        self.stop()

    def drain(self, deadline: float) -> None:
        """Let the requests in flight finish until `deadline` less the margin, then give up
        on the rest (`give_up`) and wait for them to answer until `deadline`."""
        self.wait_idle(deadline - drain_margin(deadline - time.monotonic()))
        if self.inflight():
            self.give_up()
            self.wait_idle(deadline)

    def give_up(self) -> None:
        """End the requests still in flight at the grace's end (a role's own way)."""

    def inflight(self) -> int:
        with self._inflight_lock:
            return self._inflight

    def wait_idle(self, until: float, poll: float = 0.1) -> bool:
        """Wait until no request is in flight or `until` (monotonic) passes: whether idle."""
        with self._inflight_lock:
            while self._inflight and time.monotonic() < until:
                self._inflight_lock.wait(min(poll, max(0.0, until - time.monotonic())))
            return not self._inflight

    def stop(self) -> None:
        self.draining.set()
        if self._server is not None:
            self._server.stop(1.0).wait()
        if self._health is not None:
            self._health.stop()
        if self.engine is not None:
            self.engine.close()
        self.store.close()
        if self._segment is not None:
            self._segment.stop()

    # -- request accounting ----------------------------------------------------------------

    def admit(self, context: grpc.ServicerContext) -> E:
        """Count a request in, or abort it when the worker cannot take it."""
        if self.draining.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} is draining")
        # The engine's own state only: a segment between registrations (a master restarting)
        # costs readiness, not the requests already routed here.
        reason = self.engine_state()
        if reason is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role}: {reason}")
        with self._inflight_lock:
            self._inflight += 1
        assert self.engine is not None
        return self.engine

    def loaded(self) -> E:
        """The engine, where only an admitted request (or the engine's own thread) can be:
        it is loaded by then."""
        if self.engine is None:
            raise RuntimeError(f"{self.role}: the engine is not loaded")
        return self.engine

    def engine_call(self, fn: Callable[..., R], *args: Any) -> R:
        """Call into the engine under the liveness watchdog (a prefill)."""
        with self.watchdog.waiting():
            injected_hang(self.role)
            return fn(*args)

    def watched(self, items: Iterator[T]) -> Iterator[T]:
        """The engine's stream with each wait for its next item under the liveness watchdog
        (closing this closes the engine's stream)."""
        try:
            while True:
                with self.watchdog.waiting():
                    injected_hang(self.role)
                    item = next(items, _END)
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def release(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1
            self._inflight_lock.notify_all()

    def load_report(self) -> pb.LoadReport:
        e = self.engine
        report = pb.LoadReport(
            instance_id=self.config.instance_id, role=self.role, revision=self.config.revision,
            ready=self.not_ready() is None, draining=self.draining.is_set(),
            local_segment=self.local_segment, host_id=self.host_id,
        )
        if e is not None:
            info: EngineInfo = e.info
            report.model = info.served_name
            report.model_fingerprint = info.fingerprint
            report.dtype = info.dtype
            report.block_tokens = info.block_tokens
            report.max_context = info.max_context
            report.engine = info.kind
            report.kv_layout = info.kv_layout
            report.bootstrap_addr = info.bootstrap_addr
            report.tokenizer_fingerprint = info.tokenizer_fingerprint
        return report


class PrefillWorker(Worker[PrefillEngine]):
    """A worker whose engine prefills."""

    role = "prefill"

    def open_engine(self, kind: type[EngineKind], ctx: EngineContext) -> PrefillEngine:
        return kind.open_prefill(ctx)


class DecodeWorker(Worker[DecodeEngine]):
    """A worker whose engine decodes; at drain it hands live streams over (module doc)."""

    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._handing: set[str] = set()

    def open_engine(self, kind: type[EngineKind], ctx: EngineContext) -> DecodeEngine:
        return kind.open_decode(ctx)

    def handing_over(self, request_id: str) -> bool:
        """Whether the drain asked for this stream to be handed over."""
        return request_id in self._handing

    def handoff_segment(self) -> str:
        """Where handed-over KV goes: the DRAM segment with the most free room other than this
        worker's own, which leaves with it ("" = the store's choice)."""
        try:
            segs = self.store.segments()
        except StoreError as e:
            log.warning("no segment list for the handoff", extra={"error": str(e)})
            return ""
        ok = [s for s in segs if s.name != self.local_segment and s.tier == "dram"]
        return max(ok, key=lambda s: s.size - s.used).name if ok else ""

    def drain(self, deadline: float) -> None:
        engine = self.engine
        if not isinstance(engine, HandoffEngine):
            self.wait_idle(deadline)  # cut at the grace's end: the Conductor's failover path
            return
        margin = drain_margin(deadline - time.monotonic())
        segment: str | None = None  # asked at the first handoff: an idle drain asks no one
        while not self.wait_idle(time.monotonic() + 0.05, poll=0.05):
            left = deadline - margin - time.monotonic()
            if left <= -margin:
                return
            step = engine.step_estimate()
            for st in engine.streams():
                if st.request_id in self._handing:
                    continue
                if hand_off_now(st, step, left):
                    if segment is None:
                        segment = self.handoff_segment()
                    self._handing.add(st.request_id)
                    engine.handoff(st.request_id, segment, self.local_segment)


class _EngineCounters:
    """Counters the engine keeps itself (e.g. in vLLM's processes), read at scrape time."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.engine = engine

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        engine = self.engine()
        if engine is None:
            return
        families: dict[str, CounterMetricFamily] = {}
        for c in engine.counters():
            fam = families.get(c.name)
            if fam is None:
                fam = families[c.name] = CounterMetricFamily(c.name, c.help,
                                                             labels=sorted(c.labels))
            fam.add_metric([c.labels[k] for k in sorted(c.labels)], c.value)
        yield from families.values()


class _KeepCounters:
    """What this worker's store client kept of the blocks it read from another host (the
    plan's `keep_fetched`, hot-block replication), read at scrape time."""

    def __init__(self, store: StoreClient) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "mooncake_worker_keep_blocks", "Blocks read from another host and kept on this "
            "host: kept, skipped (this host had a copy already) or failed (no room, gone)",
            labels=["outcome"])
        fam.add_metric(["kept"], self.store.kept_blocks)
        fam.add_metric(["skipped"], self.store.keep_skipped)
        fam.add_metric(["failed"], self.store.keep_failures)
        yield fam


def run_worker(worker: Worker[E]) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop. If the engine's own process dies (a
    vLLM server), stop and exit non-zero: the supervisor (`mooncake up`, Kubernetes) restarts
    the worker, and a worker that can never serve again does not linger unready."""
    done = stop_requested()
    worker.start()
    log.info(
        f"{worker.role} listening",
        extra={"address": worker.address, "metrics_port": worker.metrics_port,
               "instance_id": worker.config.instance_id, "auth": bool(worker.config.token)},
    )
    failed: str | None = None
    while not done.wait(0.5):
        engine = worker.engine
        failed = engine.failure() if engine is not None else worker.engine_error
        if failed:
            log.error(f"{worker.role} engine failed ({failed}); stopping so it is restarted")
            break
    log.info(f"{worker.role} draining")
    worker.drain_and_stop()
    log.info(f"{worker.role} stopped")
    if failed:
        sys.exit(1)
