"""The arrival process: send a dataset at a rate, a concurrency cap or a trace's own times.

Three ways requests arrive, as in `vllm bench serve`:

- `request_rate = inf`: all at once (a burst; combine with `max_concurrency` for a closed loop
  of C clients);
- a finite rate: a Poisson process, exponential gaps drawn from `seed`, rescaled so the last
  arrival is at N / rate exactly (as vLLM does: otherwise the realised rate of a short run is
  off by several percent and throughput numbers wander with the seed);
- `request_rate = None` with a trace: each request at its `arrival_s`.

Arrivals are scheduled against one start time, so a slow send never shifts the ones after it.
The concurrency cap is a semaphore taken after arrival: the wait for it is recorded per request
(`queue_wait`) but, as in vLLM, is not part of TTFT or E2EL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np

from bench.serve import client, datasets
from bench.serve.client import ApiConfig, RequestOutput, RequestSpec

WARMUP_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float | None  # None: trace timestamps (or inf when there are none)
    max_concurrency: int | None
    seed: int = 0
    warmup: int = 1  # untimed requests first: connection set-up, lazy server init
    progress: bool = True


def arrival_times(specs: Sequence[RequestSpec], rate: float | None, seed: int) -> list[float]:
    """Offsets (s) from the start of the run at which each request is sent."""
    n = len(specs)
    if rate is None:
        return [s.arrival_s or 0.0 for s in specs]
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return [float(t) for t in times]


def new_session() -> aiohttp.ClientSession:
    # No pool limit here: --max-concurrency is enforced by our own semaphore, and a pool limit
    # would add a hidden client-side queue that shows up as server latency.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def warm_up(session: aiohttp.ClientSession, api: ApiConfig, count: int) -> None:
    """Short untimed requests; a server that cannot answer one stops the run right here.

    With its own, shorter timeout: a deployment that accepts requests but never answers them
    (a dead engine thread) should fail the run in minutes, not after --request-timeout.
    """
    api = dataclasses.replace(api, timeout_s=min(api.timeout_s, WARMUP_TIMEOUT_S))
    for _ in range(count):
        spec = RequestSpec(prompt=datasets.fresh_prompt(16, api.endpoint), prompt_len=16,
                           output_len=2, tag="warmup")
        out = await client.send(session, api, spec)
        if not out.success and not out.rejected:
            raise RuntimeError(f"warm-up request to {api.url} failed: {out.error}")


class _Progress:
    """One line per ~10% done on stderr: enough to see a run is alive, cheap on 2 cores."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled and total > 0
        self.done = 0
        self.failed = 0
        self.t0 = time.perf_counter()
        self.step = max(1, math.ceil(total / 10))
        self.next_report = self.step

    def update(self, out: RequestOutput) -> None:
        self.done += 1
        self.failed += not out.success
        if self.enabled and (self.done >= self.next_report or self.done == self.total):
            self.next_report += self.step
            print(f"  [{self.label}] {self.done}/{self.total} done, {self.failed} failed, "
                  f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)


async def run(api: ApiConfig, specs: Sequence[RequestSpec], cfg: LoadConfig,
              label: str = "load") -> tuple[list[RequestOutput], float]:
    """Send every request on schedule; returns the records (in dataset order) and duration."""
    times = arrival_times(specs, cfg.request_rate, cfg.seed)
    sem: asyncio.Semaphore | None = (
        asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None)
    progress = _Progress(len(specs), label, cfg.progress)
    async with new_session() as session:
        if cfg.warmup:
            await warm_up(session, api, cfg.warmup)

        async def one(spec: RequestSpec, at: float, t0: float) -> RequestOutput:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            arrived = time.perf_counter()
            async with sem if sem is not None else contextlib.nullcontext():
                out = await client.send(session, api, spec)
            out.queue_wait = out.start - arrived
            progress.update(out)
            return out

        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(one(s, at, t0) for s, at in zip(specs, times,
                                                                            strict=True)))
        duration = time.perf_counter() - t0
    return list(outputs), duration
