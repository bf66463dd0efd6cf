"""The Conductor process: instance pools, the store client, the tokenizer and the HTTP server."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from mooncake_k8s.common import defaults
from mooncake_k8s.conductor.http.api import Frontend, load_api_keys, make_app, max_token_bytes
from mooncake_k8s.conductor.http.bodies import EdgeLimits
from mooncake_k8s.conductor.http.listener import HeaderDeadlines
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched import costmodel
from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig
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
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    """Body size, JSON depth and connection timeouts of the HTTP front door."""


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
        self.frontend = Frontend(
            Pipeline(self.prefills, self.decodes, self.router, metrics=self.metrics),
            self.metrics, keys, config.served_model_name, config.use_prefix_cache,
            config.limits)
        self.deadlines = HeaderDeadlines(config.limits.header_timeout_s,
                                         self.metrics.header_timeouts.inc)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        if self.store is not None and self.config.use_prefix_cache:
            self._feeder = IndexFeeder(self.index, self.store, asyncio.get_running_loop())
            self._feeder.start()
        await self.prefills.start()
        await self.decodes.start()
        # handler_cancellation: a client that hangs up cancels its handler, and with it the
        # gRPC calls, even while nothing is being written (prefill, a non-streamed request).
        # auto_decompress off: compressed bodies are refused (415), never inflated.
        self._runner = web.AppRunner(make_app(self.frontend, self.deadlines),
                                     handler_cancellation=True)
        await self._runner.setup()
        self._listener = await self.deadlines.serve(
            self._runner, self.config.host, self.config.port, access_log=None,
            keepalive_timeout=self.config.limits.idle_timeout_s, auto_decompress=False)
        sockets = list(self._listener.sockets)
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port

    def _load_tokenizer(self) -> None:
        try:
            tokenizer = load_tokenizer(self.config.engine)
            self.frontend.max_token_bytes = max_token_bytes(tokenizer)
            self.frontend.tokenizer = tokenizer
        except Exception as e:
            self.frontend.tokenizer_error = f"{type(e).__name__}: {e}"
            log.exception("tokenizer failed to load")

    async def stop(self) -> None:
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


def load_tokenizer(engine: EngineConfig) -> Any:
    """The workers' tokenizer without their weights: the Conductor tokenises to route."""
    from transformers import AutoTokenizer

    from mooncake_k8s.engine.loading import ensure_builtin

    path = Path(engine.model) if engine.model else ensure_builtin(progress=False)[0]
    return AutoTokenizer.from_pretrained(str(path))


def run_conductor(config: ConductorConfig) -> None:
    async def main() -> None:
        conductor = Conductor(config)
        await conductor.start()
        log.info("conductor listening",
                 extra={"address": f"{config.host}:{conductor.port}",
                        "auth": conductor.frontend.api_keys is not None})
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        log.info("conductor stopping")
        await conductor.stop()

    asyncio.run(main())
