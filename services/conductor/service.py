"""The Conductor process: instance pools, the store client, the tokenizer and the HTTP servers.

Two listeners: the OpenAI API (`port`) and, apart from it, /metrics with /healthz and /readyz
(`metrics_port`), so that scraping needs no API key and exposing the API exposes nothing else.

The tokenizer must be the workers' (`common.tokenizer_id`): the pools route only to instances
whose reported tokenizer fingerprint equals the Conductor's, and /readyz says why when none does.

Shutdown (SIGTERM or SIGINT) drains: readiness turns 503 first, the API listener closes (new
connections are refused) and idle kept-alive connections with it, requests and streams in flight
run to their end for at most `shutdown_timeout_s`, then everything stops and the process exits 0.
A second signal ends the wait at once. In Kubernetes a preStop pause comes before the SIGTERM,
so endpoints stop sending new connections before the listener closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import Gauge

from mooncake_k8s.common import defaults
from mooncake_k8s.common.tokenizer_id import tokenizer_fingerprint
from mooncake_k8s.conductor.http.api import (
    Frontend,
    load_api_keys,
    make_app,
    make_ops_app,
    max_token_bytes,
)
from mooncake_k8s.conductor.http.bodies import EdgeLimits
from mooncake_k8s.conductor.http.listener import HeaderDeadlines
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched import costmodel
from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig
from mooncake_k8s.conductor.sched.fairshare import FairShare
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.indexfeed import IndexFeeder
from mooncake_k8s.conductor.serving.instances import InstancePool
from mooncake_k8s.conductor.serving.pipeline import Pipeline
from mooncake_k8s.conductor.serving.router import MooncakeRouter
from mooncake_k8s.store.client import StoreClient

if TYPE_CHECKING:
    from mooncake_k8s.engine import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class ConductorConfig:
    prefill: str
    decode: str
    engine: EngineConfig
    """Only the tokenizer is loaded from it; the workers hold the weights."""
    master: str | None = None
    token: str = ""
    host: str = "127.0.0.1"
    port: int = defaults.CONDUCTOR_PORT
    api_keys_file: str | None = None
    served_model_name: str | None = None
    use_prefix_cache: bool = True
    poll_interval_s: float = 0.5
    policy: str = "global_cache_aware"
    """Scheduling policy (`policies.POLICIES`)."""
    cost_model: str | None = None
    """A cost model file (`mooncake calibrate`) or shipped profile; None = the default for the
    model served (`costmodel.default_profile`: the measured CPU profile for the built-in model
    on a CPU, else the paper's LLaMA3-70B one)."""
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    """With either set, requests predicted to miss it are refused up front (429)."""
    tenant_fair_share: int = 0
    """Concurrent requests above which a tenant holding its fair share of them is refused
    (429, `sched.fairshare`: max-min fair sharing between tenants); 0 = off."""
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    """Body size, JSON depth and connection timeouts of the HTTP front door."""
    metrics_port: int | None = defaults.CONDUCTOR_METRICS_PORT
    """/metrics, /healthz and /readyz; 0 = any free port, None = no metrics listener."""
    metrics_host: str | None = None
    """Where the metrics listener binds (default: `host`)."""
    metrics_on_api_port: bool = False
    """Also answer /metrics on the API port (how it was before the metrics port existed)."""
    shutdown_timeout_s: float = defaults.CONDUCTOR_SHUTDOWN_TIMEOUT_S
    """After SIGTERM, how long in-flight requests and streams may take to finish."""
    stream_stall_timeout_s: float | None = defaults.STREAM_STALL_TIMEOUT_S
    """A decode stream silent this long after its first chunk is resumed on another instance
    (`Pipeline.stall_timeout_s`); None = no per-token deadline."""
    index_warmup_timeout_s: float = defaults.CONDUCTOR_INDEX_WARMUP_S
    """How long /readyz waits for the store's snapshot to fill the KV index (`indexfeed`);
    past it the Conductor is ready with what it has (cache-blind if the store is down)."""


class Conductor:
    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.metrics = ConductorMetrics()
        self.prefills = InstancePool("prefill", config.prefill, config.token,
                                     config.poll_interval_s)
        self.decodes = InstancePool("decode", config.decode, config.token,
                                    config.poll_interval_s)
        self.store = (StoreClient(config.master, config.token, timeout_s=2.0)
                      if config.master else None)
        keys = load_api_keys(config.api_keys_file) if config.api_keys_file else None
        slo = SLO(config.ttft_slo_ms, config.tbt_slo_ms)
        self.index = KVIndex()
        self.scheduler = Scheduler(SchedulerConfig(
            policy=config.policy, admission=AdmissionConfig(slo) if slo.active else None,
        ), costmodel.load(config.cost_model or costmodel.default_profile(
            config.engine.model, config.engine.device)), self.index)
        self.router = MooncakeRouter(self.scheduler, self.store, self.metrics)
        self._feeder: IndexFeeder | None = None
        self._index_gave_up = False
        self._index_gauges()
        self.frontend = Frontend(
            Pipeline(self.prefills, self.decodes, self.router, metrics=self.metrics,
                     fair=FairShare(config.tenant_fair_share)
                     if config.tenant_fair_share > 0 else None,
                     stall_timeout_s=config.stream_stall_timeout_s),
            self.metrics, keys, config.served_model_name, config.use_prefix_cache,
            config.limits)
        self.frontend.index_not_ready = self._index_not_ready
        self.deadlines = HeaderDeadlines(config.limits.header_timeout_s,
                                         self.metrics.header_timeouts.inc)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._ops: web.AppRunner | None = None
        self._tokenizer_task: asyncio.Task[None] | None = None
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> None:
        self._tokenizer_task = asyncio.create_task(self._load_tokenizer())
        if self.store is not None and self.config.use_prefix_cache:
            self._feeder = IndexFeeder(self.index, self.store, asyncio.get_running_loop())
            self._feeder.start()
        await self.prefills.start()
        await self.decodes.start()
        # handler_cancellation: a client that hangs up cancels its handler, and with it the
        # gRPC calls, even while nothing is being written (prefill, a non-streamed request).
        # auto_decompress off: compressed bodies are refused (415), never inflated.
        await self._start_metrics()
        # shutdown_timeout: `drain` has already given requests their time; what runs after it
        # is cancelled at once, so the process exits within the pod's grace period.
        self._runner = web.AppRunner(make_app(self.frontend, self.deadlines,
                                              with_metrics=self.config.metrics_on_api_port),
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        self._listener = await self.deadlines.serve(
            self._runner, self.config.host, self.config.port, access_log=None,
            keepalive_timeout=self.config.limits.idle_timeout_s, auto_decompress=False)
        sockets = list(self._listener.sockets)
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port

    def _index_gauges(self) -> None:
        """The KV index's size and whether it holds the store's snapshot, read at scrape time
        (how an operator, or a test, sees that replicas know the same blocks)."""
        r = self.metrics.registry
        Gauge("mooncake_conductor_kv_index_blocks",
              "Block keys the KV index knows (the store's snapshot plus its events since)",
              registry=r).set_function(lambda: len(self.index))
        Gauge("mooncake_conductor_kv_index_warm",
              "1 once the KV index holds the store's snapshot (0: still loading, or no store)",
              registry=r).set_function(
                  lambda: float(self._feeder is not None and self._feeder.warm))

    def _index_not_ready(self) -> str | None:
        """Why /readyz waits for the KV index: until the store's first snapshot is applied,
        for at most `index_warmup_timeout_s` (then once logged: ready, cache-blind)."""
        feeder = self._feeder
        if feeder is None or feeder.warm or self._index_gave_up:
            return None
        if time.monotonic() - feeder.started < self.config.index_warmup_timeout_s:
            return "loading the KV index from the store's snapshot"
        self._index_gave_up = True
        log.warning("no snapshot from the store in time: ready with an empty KV index "
                    "(routing is cache-blind until the store answers)",
                    extra={"master": self.config.master,
                           "waited_s": self.config.index_warmup_timeout_s})
        return None

    async def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        self._ops = web.AppRunner(make_ops_app(self.frontend), access_log=None)
        await self._ops.setup()
        site = web.TCPSite(self._ops, self.config.metrics_host or self.config.host,
                           self.config.metrics_port, reuse_address=True)
        await site.start()
        bound = self._ops.addresses  # the port actually bound, when 0 asked for any
        self.metrics_port = int(bound[0][1]) if bound else self.config.metrics_port

    async def _load_tokenizer(self) -> None:
        """Off the event loop (seconds for a large vocabulary); the pools learn the fingerprint
        before the front door gets the tokenizer, so no request is routed unchecked."""
        def load() -> tuple[Any, str, int | None]:
            tokenizer = load_tokenizer(self.config.engine)
            return tokenizer, tokenizer_fingerprint(tokenizer), max_token_bytes(tokenizer)

        try:
            tokenizer, fp, per_token = await asyncio.get_running_loop().run_in_executor(
                None, load)
        except Exception as e:
            self.frontend.tokenizer_error = f"{type(e).__name__}: {e}"
            log.exception("tokenizer failed to load")
            return
        self.frontend.tokenizer_source = self.config.engine.model or "the built-in model"
        self.frontend.tokenizer_fingerprint = fp
        self.prefills.expect_tokenizer(fp)
        self.decodes.expect_tokenizer(fp)
        self.frontend.max_token_bytes = per_token
        self.frontend.tokenizer = tokenizer
        log.info("tokenizer loaded", extra={"source": self.frontend.tokenizer_source,
                                            "fingerprint": fp})

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> None:
        """Readiness off, API listener closed, in-flight requests given `timeout_s` to end
        (or until `hurry` is set)."""
        self.frontend.draining = True
        if self._listener is not None:
            self._listener.close()  # synchronous: after this, connecting is refused
        idle = self.deadlines.close_idle()
        busy = self.deadlines.busy_connections
        log.info("conductor draining", extra={"in_flight": busy, "idle_closed": idle,
                                              "timeout_s": timeout_s})
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.deadlines.drained())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        _, pending = await asyncio.wait(waits, timeout=timeout_s,
                                        return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        left = self.deadlines.busy_connections
        if left:
            log.warning("stopping with requests still in flight", extra={"in_flight": left})

    async def stop(self) -> None:
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        if self._feeder is not None:
            self._feeder.stop()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.prefills.close()
        await self.decodes.close()
        if self.store is not None:
            self.store.close()
        if self._ops is not None:
            await self._ops.cleanup()


def load_tokenizer(engine: EngineConfig) -> Any:
    """The workers' tokenizer without their weights: the Conductor tokenises to route."""
    from mooncake_k8s.engine.loading import ModelLoadError, ensure_builtin
    from mooncake_k8s.engine.loading import load_tokenizer as from_dir

    path = Path(engine.model) if engine.model else ensure_builtin(progress=False)[0]
    tokenizer = from_dir(path)
    if tokenizer is None:
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json, "
                             "tokenizer_config.json or tokenizer.model)")
    return tokenizer


def run_conductor(config: ConductorConfig) -> None:
    async def main() -> None:
        conductor = Conductor(config)
        await conductor.start()
        log.info("conductor listening",
                 extra={"address": f"{config.host}:{conductor.port}",
                        "metrics_port": conductor.metrics_port,
                        "auth": conductor.frontend.api_keys is not None})
        done, hurry = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            (hurry if done.is_set() else done).set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await done.wait()
        await conductor.drain(config.shutdown_timeout_s, hurry)
        log.info("conductor stopping")
        await conductor.stop()

    asyncio.run(main())
