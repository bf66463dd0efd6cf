"""Simulated prefill and decode instances, timed by a `CostModel`.

Prefill: one request at a time, first come first served (prefill is compute-bound; two at once
only share the GPUs). Each instance owns a local KV cache in DRAM, exact LRU over blocks, and
reports what it stores and evicts to the `KVIndex` as the store does with block events, so the
scheduler sees cold caches go cold. What a request finds is checked again when it *starts*:
blocks evicted while it queued are recomputed (a miss costs time, never correctness), exactly
as the real prefill service does.

Decode: continuous batching in steps. A step's duration is the cost model's
``step_ms(batch, context)``; every running sequence emits one token per step; a request joins
at the first step boundary after its KV arrives if its reserved KV (prompt + output) fits. To
stay fast over hour-long traces the steps between two batch changes are simulated in one chunk
(their durations form an arithmetic series, since the context grows by `batch` tokens per
step), and each request's token intervals are recovered from the recorded step series.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mooncake_k8s.conductor.sched.costmodel import CostModel
from mooncake_k8s.conductor.sched.kvindex import KVIndex


@dataclass(slots=True)
class Job:
    rid: int
    arrival_ms: float
    keys: Sequence[int]
    prompt: int
    fetch_upto: int
    """Blocks of prefix to take from the pool when it starts (0: only what is local)."""
    replicate: bool
    predicted_ms: float


@dataclass(slots=True)
class Done:
    """What running a prefill job produced."""

    cached_tokens: int
    local_blocks: int
    fetched_blocks: int
    compute_ms: float


class PrefillSim:
    def __init__(self, slot: int, model: CostModel, index: KVIndex, capacity_blocks: int,
                 block_tokens: int, noise: float = 0.0, seed: int = 0) -> None:
        self.slot = slot
        self.model = model
        self.index = index
        self.block_tokens = block_tokens
        self.capacity = capacity_blocks
        self.bit = index.segment(f"prefill-{slot}-dram")
        self.mask = 1 << self.bit
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[Job] = deque()
        self.queued_ms = 0.0
        self.current: Job | None = None
        self._done: Done | None = None
        self.busy_until = 0.0
        self.busy_ms = 0.0
        self.evictions = 0
        self.replicated_blocks = 0
        self._noise = noise
        self._rng = np.random.default_rng(seed)

    def queue_ms(self, now: float) -> float:
        return max(0.0, self.busy_until - now) + self.queued_ms

    def _tokens(self, blocks: int, prompt: int) -> int:
        return max(0, min(blocks * self.block_tokens, prompt - 1))

    def submit(self, job: Job, now: float) -> float | None:
        """Queue a job; returns its finish time if it starts right away."""
        self.queue.append(job)
        self.queued_ms += job.predicted_ms
        return self._start_next(now) if self.current is None else None

    def _start_next(self, now: float) -> float | None:
        if not self.queue:
            return None
        job = self.queue.popleft()
        self.queued_ms = max(0.0, self.queued_ms - job.predicted_ms)
        self.current = job
        dur, done = self._execute(job)
        self._done = done
        self.busy_until = now + dur
        self.busy_ms += dur
        return self.busy_until

    def _execute(self, job: Job) -> tuple[float, Done]:
        cache, m = self.cache, self.model
        local = 0
        for k in job.keys:
            if k not in cache:
                break
            cache.move_to_end(k)  # in use: the most recently used, never the next victim
            local += 1
        upto = local
        if job.fetch_upto > local:
            hm = self.index.match(job.keys[local:job.fetch_upto], ())
            upto = local + hm.global_blocks
        c_local = self._tokens(local, job.prompt)
        c_all = self._tokens(upto, job.prompt)
        compute = m.prefill_ms(job.prompt - c_all, c_all)
        if self._noise:
            compute *= float(self._rng.lognormal(0.0, self._noise))
        dur = m.transfer_ms("local", c_local) + m.remote_ms(c_all - c_local) + compute
        return dur, Done(c_all, local, upto - local, compute)

    def finish(self, now: float) -> tuple[Job, Done, float | None]:
        """The running job completed at `now`: store its blocks, start the next one."""
        job, done = self.current, self._done
        assert job is not None and done is not None
        keep_from = 0 if job.replicate else done.local_blocks + done.fetched_blocks
        self._store(job.keys[:done.local_blocks], job.keys[done.local_blocks:], keep_from,
                    done)
        self.current = None
        return job, done, self._start_next(now)

    def _store(self, touched: Sequence[int], rest: Sequence[int], keep_from: int,
               done: Done) -> None:
        cache, index, bit = self.cache, self.index, self.bit
        base = len(touched)
        for i, k in enumerate(rest):
            if base + i < keep_from:
                continue  # fetched but not replicated: it stays where it came from
            if k in cache:
                cache.move_to_end(k)
                continue
            cache[k] = None
            index.add(k, bit)
            if base + i < base + done.fetched_blocks:
                self.replicated_blocks += 1
        while len(cache) > self.capacity:
            victim, _ = cache.popitem(last=False)
            index.discard(victim, bit)
            self.evictions += 1


@dataclass(order=True, slots=True)
class _Waiting:
    arrive_ms: float
    rid: int
    token1_ms: float = field(compare=False)
    steps: int = field(compare=False)
    reserve: int = field(compare=False)
    ctx: int = field(compare=False)


class DecodeSim:
    def __init__(self, slot: int, model: CostModel, capacity_tokens: int) -> None:
        self.slot = slot
        self.model = model
        self.capacity = capacity_tokens
        self.t = 0.0
        self.nsteps = 0
        self.reserved = 0
        self.ctx_sum = 0
        self._running: list[tuple[int, int, int, int]] = []  # heap: (end step, rid, res, ctx)
        self._waiting: list[_Waiting] = []
        self._chunks: list[tuple[float, float, float, int]] = []  # (t0, d0, slope, n)
        self.joins: dict[int, tuple[int, int, float]] = {}  # rid -> (first step, steps, t1)
        self.max_batch = 0

    @property
    def running(self) -> int:
        return len(self._running)

    def push(self, arrive_ms: float, rid: int, token1_ms: float, steps: int, prompt: int,
             reserve: int) -> None:
        if steps <= 0:
            return
        heapq.heappush(self._waiting, _Waiting(arrive_ms, rid, token1_ms, steps, reserve,
                                               prompt + 1))

    def _admit(self) -> None:
        w = self._waiting
        while w and w[0].arrive_ms <= self.t:
            head = w[0]
            if self._running and self.reserved + head.reserve > self.capacity:
                return  # first come first served: the head waits for room
            heapq.heappop(w)
            self.reserved += head.reserve
            self.ctx_sum += head.ctx
            heapq.heappush(self._running, (self.nsteps + head.steps, head.rid, head.reserve,
                                           head.ctx + head.steps))
            self.joins[head.rid] = (self.nsteps, head.steps, head.token1_ms)
        self.max_batch = max(self.max_batch, len(self._running))

    def advance(self, until_ms: float) -> None:
        """Simulate every step that starts before `until_ms`."""
        dec = self.model.decode
        while True:
            self._admit()
            run, w = self._running, self._waiting
            if not run:
                if w and w[0].arrive_ms < until_ms:
                    self.t = max(self.t, w[0].arrive_ms)
                    continue
                self.t = max(self.t, until_ms) if math.isfinite(until_ms) else self.t
                return
            if self.t >= until_ms:
                return
            b = len(run)
            d0 = dec.step_ms(b, self.ctx_sum)
            slope = dec.per_ctx_token_ms * b
            k = run[0][0] - self.nsteps
            # The next arrival bounds the chunk, unless it already arrived and is blocked
            # on KV room (then only a finish, at k, can change anything).
            nxt = w[0].arrive_ms if w and w[0].arrive_ms > self.t else math.inf
            limit = min(until_ms, nxt)
            n = k if not math.isfinite(limit) else max(1, min(k, _steps_before(
                limit - self.t, d0, slope)))
            self._chunks.append((self.t, d0, slope, n))
            self.t += n * d0 + slope * n * (n - 1) / 2
            self.nsteps += n
            self.ctx_sum += n * b
            while run and run[0][0] <= self.nsteps:
                _, _, res, ctx_end = heapq.heappop(run)
                self.reserved -= res
                self.ctx_sum -= ctx_end

    def step_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(duration, end time) of every step simulated, in order."""
        if not self._chunks:
            return np.zeros(0), np.zeros(0)
        durs = []
        ends = []
        for t0, d0, slope, n in self._chunks:
            j = np.arange(n, dtype=np.float64)
            d = d0 + slope * j
            durs.append(d)
            ends.append(t0 + np.cumsum(d))
        return np.concatenate(durs), np.concatenate(ends)


def _steps_before(window: float, d0: float, slope: float) -> int:
    """How many steps start within `window` ms: the j with j*d0 + slope*j*(j-1)/2 < window."""
    if window <= 0:
        return 0
    if slope <= 0:
        return math.ceil(window / d0) if d0 > 0 else 1 << 40
    # slope/2 j^2 + (d0 - slope/2) j - window < 0
    a, b = slope / 2, d0 - slope / 2
    root = (-b + math.sqrt(b * b + 4 * a * window)) / (2 * a)
    return max(0, math.ceil(root))


def tbt_of(durs: np.ndarray, ends: np.ndarray, first_step: int, steps: int,
           token1_ms: float) -> float:
    """Mooncake's TBT for one request: the mean of its slowest 10% of token intervals (the
    first interval runs from the prefill's first token to the end of its first step)."""
    first = float(ends[first_step]) - token1_ms
    rest = durs[first_step + 1:first_step + steps]
    iv = np.concatenate(([first], rest))
    k = max(1, math.ceil(0.1 * iv.size))
    if k >= iv.size:
        return float(iv.mean())
    top = np.partition(iv, iv.size - k)[iv.size - k:]
    return float(top.mean())
