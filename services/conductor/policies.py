"""The scheduling decision: which prefill and which decode instance, or a 429. Pure.

`Scheduler.decide` is Mooncake's Algorithm 1 and the baselines it is measured against, over a
typed view of the cluster (`PrefillView`, `DecodeView`) and the global KV index; it does no
I/O, so the live Conductor (`MooncakeRouter`, below) and the trace simulator (`sim/`) run
exactly this code, and its tests need no servers.

Policies (all pick decode by predicted TBT unless they are the two blind ones):

- `random`, `round_robin`: ignore load and cache (prefill and decode alike). A request still
  reuses whatever its instance happens to hold locally.
- `load_balancing`: the prefill instance with the shortest predicted queue.
- `local_cache_aware`: least `queue + load(local prefix) + prefill(rest)`: cache-aware, but
  only for what an instance holds itself.
- `global_cache_aware` (Algorithm 1): also considers fetching the longest prefix held anywhere
  in the pool: least `queue + load(local) + transfer(pool prefix it lacks) + prefill(rest)`.
  When it fetches, the blocks are kept where they were fetched to (hot-block replication): the
  next request with that prefix finds it locally on one more instance.

With early rejection, the decision is then judged against the SLOs (`admission.judge`) using
the predicted TTFT and the TBT predicted from the decode load the request will meet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING

from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.conductor.admission import (
    AdmissionConfig,
    DecodeLedger,
    Overloaded,
    Verdict,
    judge,
)
from mooncake_k8s.conductor.costmodel import CostModel
from mooncake_k8s.conductor.kvindex import KVIndex, Match

if TYPE_CHECKING:
    from mooncake_k8s.conductor.instances import Instance
    from mooncake_k8s.conductor.metrics import ConductorMetrics
    from mooncake_k8s.conductor.scheduler import Route, RouteRequest
    from mooncake_k8s.store.client import StoreClient

log = logging.getLogger(__name__)

POLICIES = ("random", "round_robin", "load_balancing", "local_cache_aware",
            "global_cache_aware")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "global_cache_aware"
    block_tokens: int = BLOCK_TOKENS
    """Tokens per KV block (the cluster's; the simulator uses the trace's)."""
    admission: AdmissionConfig | None = None
    """None: admit everything (no early rejection)."""
    replicate_min_blocks: int = 1
    """Keep a local replica of a fetched prefix only when at least this many blocks were
    fetched; raise it to spend local DRAM only on long shared prefixes."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.replicate_min_blocks < 1:
            raise ValueError("replicate_min_blocks must be >= 1")


@dataclass(slots=True)
class Demand:
    """What one request asks for, as the scheduler sees it."""

    keys: Sequence[Hashable]
    """Block keys of the prompt's full blocks, in order."""
    prompt_tokens: int
    max_tokens: int
    """Output tokens to plan for (the request's limit: the scheduler cannot know more)."""
    priority: str = "interactive"


@dataclass(slots=True)
class PrefillView:
    slot: int
    """Stable id of the instance (KV index masks and ledgers are keyed by it)."""
    queue_ms: float
    """Predicted time until a new request would start computing here."""
    local_mask: int = 0
    """KV index mask of this instance's own segments (0: it holds nothing locally)."""


@dataclass(slots=True)
class DecodeView:
    slot: int
    running: int = 0
    """Sequences the instance reports running (0 when unknown)."""
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    """0 = unknown: the cost model's capacity applies (or none)."""


@dataclass(slots=True)
class Decision:
    prefill: int
    """Index into the `prefills` given to `decide` (not the slot)."""
    decode: int
    local_blocks: int
    """Leading blocks the chosen prefill instance holds itself."""
    fetch_blocks: int
    """Further blocks it is to fetch from the pool (0 unless global-cache-aware)."""
    cached_tokens: int
    ttft_ms: float
    tbt_ms: float
    replicate: bool
    verdict: Verdict
    match: Match

    @property
    def admitted(self) -> bool:
        return self.verdict.admit


class Scheduler:
    """One policy, its RNG and round-robin state, and the decode ledger. Not thread-safe:
    the live Conductor calls it from its event loop only."""

    def __init__(self, config: SchedulerConfig, model: CostModel, index: KVIndex) -> None:
        self.config = config
        self.model = model
        self.index = index
        self.ledger = DecodeLedger()
        self.block_tokens = config.block_tokens
        """The cluster's; the live router keeps it in step with the workers' reports."""
        self._rng = random.Random(config.seed)
        self._rr_prefill = 0
        self._rr_decode = 0
        self._policy = config.policy
        self._memo: dict[tuple[int, int, int, int, int, bool], tuple[float, int]] = {}
        self._memo_model: CostModel | None = None

    # -- pieces ----------------------------------------------------------------------------

    def _tokens(self, blocks: int, prompt: int) -> int:
        """Cached tokens for a prefix of `blocks`; at least one prompt token is computed
        (its logits give the first output token)."""
        return max(0, min(blocks * self.block_tokens, prompt - 1))

    def _cost_local(self, local: int, prompt: int) -> float:
        m = self.model
        c = self._tokens(local, prompt)
        return m.transfer_ms("local", c) + m.prefill_ms(prompt - c, c)

    def _cost_global(self, local: int, match: Match, prompt: int) -> tuple[float, int]:
        """Best of computing past the local prefix or fetching the pool's longer prefix:
        (ms, blocks fetched)."""
        own = self._cost_local(local, prompt)
        g = match.global_blocks
        if g <= local:
            return own, 0
        m = self.model
        c_local = self._tokens(local, prompt)
        c_dram = self._tokens(max(local, match.dram_blocks), prompt)
        c_all = self._tokens(g, prompt)
        fetched = (m.transfer_ms("local", c_local) + m.transfer_ms("pool", c_dram - c_local)
                   + m.transfer_ms("ssd", c_all - c_dram) + m.prefill_ms(prompt - c_all, c_all))
        return (fetched, g - local) if fetched < own else (own, 0)

    def _costs(self, lengths: set[int], match: Match, prompt: int,
               glob: bool) -> dict[int, tuple[float, int]]:
        """(ms, blocks fetched) per distinct local prefix length among the candidates.

        Memoised: the candidates share a handful of lengths, and consecutive prompts the same
        few (length, match, prompt) combinations, so most decisions evaluate no cost model at
        all. The memo is dropped when the model or the block size changes, and when it grows
        past `_COSTS_MEMO` entries."""
        memo = self._memo
        bt = self.block_tokens
        if self._memo_model is not self.model:
            memo.clear()
            self._memo_model = self.model
        g, dram = match.global_blocks, match.dram_blocks
        out: dict[int, tuple[float, int]] = {}
        for li in lengths:
            key = (li, g, dram, prompt, bt, glob)
            c = memo.get(key)
            if c is None:
                c = (self._cost_global(li, match, prompt) if glob
                     else (self._cost_local(li, prompt), 0))
                if len(memo) >= _COSTS_MEMO:
                    memo.clear()
                memo[key] = c
            out[li] = c
        return out

    # -- the decision ----------------------------------------------------------------------

    def decide(self, demand: Demand, prefills: Sequence[PrefillView],
               decodes: Sequence[DecodeView], now_ms: float) -> Decision:
        """Choose (prefill, decode) for one request; record it in the ledger if admitted."""
        if not prefills or not decodes:
            raise ValueError("decide needs at least one prefill and one decode instance")
        prompt = demand.prompt_tokens
        match = self.index.match(demand.keys, [p.local_mask for p in prefills])
        local = match.local_blocks
        policy = self._policy
        fetch = 0
        if policy == "random":
            pi = self._rng.randrange(len(prefills))
            ttft = prefills[pi].queue_ms + self._cost_local(local[pi], prompt)
        elif policy == "round_robin":
            pi = self._rr_prefill % len(prefills)
            self._rr_prefill += 1
            ttft = prefills[pi].queue_ms + self._cost_local(local[pi], prompt)
        elif policy == "load_balancing":
            pi = min(range(len(prefills)), key=lambda i: prefills[i].queue_ms)
            ttft = prefills[pi].queue_ms + self._cost_local(local[pi], prompt)
        else:
            costs = self._costs(set(local), match, prompt, policy == "global_cache_aware")
            if len(costs) == 1:
                (only,) = costs.values()
                queues = [p.queue_ms for p in prefills]
                pi = queues.index(min(queues))
                ttft = queues[pi] + only[0]
            else:
                c0 = costs.get(0)
                if c0 is None:
                    ms = {li: c[0] for li, c in costs.items()}
                    totals = [p.queue_ms + ms[li] for p, li in zip(prefills, local, strict=True)]
                else:
                    # Most candidates hold nothing of the prompt: add their one cost in a
                    # tight loop, then redo the few that hold a prefix (found at C speed).
                    z = c0[0]
                    totals = [p.queue_ms + z for p in prefills]
                    for i in compress(range(len(local)), local):
                        totals[i] = prefills[i].queue_ms + costs[local[i]][0]
                ttft = min(totals)
                pi = totals.index(ttft)
            fetch = costs[local[pi]][1]
        reuse = local[pi] + fetch
        cached = self._tokens(reuse, prompt)
        self.ledger.expire(now_ms)
        di, tbt, fits, clears = self._pick_decode(demand, decodes, now_ms + ttft)
        adm = self.config.admission
        verdict = (judge(adm, demand.priority, ttft, tbt, fits, clears) if adm is not None
                   else Verdict(True))
        if verdict.admit:
            out = max(0, demand.max_tokens - 1)
            finish = now_ms + ttft + out * tbt
            self.ledger.add(decodes[di].slot, finish, prompt + demand.max_tokens)
        return Decision(pi, di, local[pi], fetch, cached, ttft, tbt,
                        fetch >= self.config.replicate_min_blocks, verdict, match)

    def _state(self, d: DecodeView, t_ms: float) -> tuple[int, int, int]:
        """(sequences, reserved tokens, capacity) predicted for a decode instance at t."""
        seqs, toks = self.ledger.at(d.slot, t_ms)
        cap = d.kv_capacity_tokens or self.model.decode.kv_capacity_tokens
        return max(seqs, d.running), max(toks, d.kv_used_tokens), cap

    def _pick_decode(self, demand: Demand, decodes: Sequence[DecodeView],
                     arrive_ms: float) -> tuple[int, float, bool, float]:
        """(index, predicted TBT, KV fits, ms until its next predicted finish)."""
        need = demand.prompt_tokens + demand.max_tokens
        step = self.model.step_ms
        if self._policy == "random":
            di = self._rng.randrange(len(decodes))
        elif self._policy == "round_robin":
            di = self._rr_decode % len(decodes)
            self._rr_decode += 1
        else:
            # Rank by the ledger's current totals (the batch-size and context terms of the
            # step time; the rest is the same for every instance), then look exactly at the
            # winner: an exact prediction for every instance would cost a bisection each.
            led = self.ledger
            dm = self.model.decode
            if led.weights != (dm.per_seq_ms, dm.per_ctx_token_ms):
                led.weigh(dm.per_seq_ms, dm.per_ctx_token_ms)
            try:
                di = _least_loaded(decodes, led, dm.kv_capacity_tokens, need)
            except IndexError:  # a slot the ledger has not seen yet
                led.ensure(max(d.slot for d in decodes) + 1)
                di = _least_loaded(decodes, led, dm.kv_capacity_tokens, need)
        n_seqs, n_toks, cap = self._state(decodes[di], arrive_ms)
        fits = not cap or n_toks + need <= cap
        tbt = step(n_seqs + 1, n_toks + need)
        clears = self.ledger.next_finish(decodes[di].slot) - arrive_ms
        return di, tbt, fits, max(0.0, clears)


_COSTS_MEMO = 4096


def _least_loaded(decodes: Sequence[DecodeView], ledger: DecodeLedger, dcap: int,
                  need: int) -> int:
    """Index of the decode instance with the least step-time load, ranked by the ledger's
    current totals or the instance's report, whichever is larger (the batch-size and context
    terms of the step time; the rest is the same for every instance). A full instance is
    chosen only if every instance is full; ties go to the first. Raises IndexError for a slot
    beyond the ledger.

    The ledger's own load is a lower bound of each instance's (a report only raises it; the
    weights are >= 0), so only the instances whose bound is within the load of the first one
    with the least bound can win: those are ranked exactly, in order; the rest are not looked
    at. When that first one's rank is its bound, it wins outright.
    """
    ps, pc = ledger.weights
    seqs, toks = ledger.seqs, ledger.tokens
    bounds = list(map(ledger.load.__getitem__, [d.slot for d in decodes]))
    first = bounds.index(min(bounds))
    bar = _decode_load(decodes[first], seqs, toks, ps, pc, dcap, need)
    if bar == bounds[first]:
        # Its rank is its bound, the least bound, and no instance before it has that bound:
        # nothing can rank lower, and a tie goes to the first (the common case).
        return first
    best = math.inf
    di = 0
    for i in compress(range(len(bounds)), map(bar.__ge__, bounds)):
        if bounds[i] >= best:
            continue  # cannot be strictly less than the best so far
        d = decodes[i]
        slot = d.slot
        s = seqs[slot]
        if d.running > s:
            s = d.running
        t = toks[slot]
        if d.kv_used_tokens > t:
            t = d.kv_used_tokens
        cap = d.kv_capacity_tokens or dcap
        v = ps * s + pc * t
        if cap and t + need > cap:
            v += 1e18  # full: only if every instance is
        if v < best:
            best, di = v, i
    return di


def _decode_load(d: DecodeView, seqs: list[int], toks: list[int], ps: float, pc: float,
                 dcap: int, need: int) -> float:
    """One instance's rank in `_least_loaded` (the same arithmetic as its loop)."""
    slot = d.slot
    s = max(seqs[slot], d.running)
    t = max(toks[slot], d.kv_used_tokens)
    cap = d.kv_capacity_tokens or dcap
    v = ps * s + pc * t
    return v + 1e18 if cap and t + need > cap else v


class MooncakeRouter:
    """The live Conductor's `Router`: `Scheduler.decide` over the instance pools.

    Views come from the instances' load reports plus what this Conductor has sent since
    (`inflight`): a prefill queue is predicted from its queued tokens with the cost model
    (their cached share is unknown here, so it is an upper bound); a decode instance's load is
    the larger of its report and the ledger. Block keys use the workers' namespace, so the
    index answers in the store's own keys. A predicted SLO miss raises `Overloaded` (429).
    A fetched hot prefix is soft-pinned in the store so it stays in the pool (the store has no
    call to add a replica of an existing object; pinning is what its API offers).
    """

    def __init__(self, scheduler: Scheduler, store: StoreClient | None = None,
                 metrics: ConductorMetrics | None = None, pin_memory: int = 4096) -> None:
        self.scheduler = scheduler
        self.index = scheduler.index
        self.store = store
        self.metrics = metrics
        self._slots: dict[str, int] = {}
        self._pinned: OrderedDict[str, None] = OrderedDict()
        self._pin_memory = pin_memory

    def _slot(self, inst: Instance) -> int:
        slot = self._slots.get(inst.address)
        if slot is None:
            slot = self._slots[inst.address] = len(self._slots)
        return slot

    def _prefill_view(self, inst: Instance) -> PrefillView:
        r = inst.report
        pf = self.scheduler.model.prefill
        queued = max(r.queued_tokens if r else 0, inst.inflight_tokens)
        jobs = max(r.queued_requests if r else 0, inst.inflight)
        mask = self.index.mask([r.local_segment]) if r and r.local_segment else 0
        return PrefillView(self._slot(inst), pf.base_ms * jobs + pf.per_token_ms * queued, mask)

    def _decode_view(self, inst: Instance) -> DecodeView:
        r = inst.report
        if r is None:
            return DecodeView(self._slot(inst), inst.inflight)
        used = max(0, r.kv_capacity_tokens - r.kv_free_tokens)
        return DecodeView(self._slot(inst), max(r.running, inst.inflight), used,
                          r.kv_capacity_tokens)

    async def route(self, req: RouteRequest, prefills: Sequence[Instance],
                    decodes: Sequence[Instance]) -> Route:
        from mooncake_k8s.common.blocks import block_keys
        from mooncake_k8s.conductor.scheduler import NoCapacity, Route, namespace_of, pick_decode

        if not prefills:
            raise NoCapacity("no prefill instance is ready")
        if not decodes:
            raise NoCapacity("no decode instance is ready")
        # During a rollout, only pair instances of one revision.
        revs = {d.report.revision for d in decodes if d.report}
        prefills = [p for p in prefills if p.report and p.report.revision in revs] or prefills
        first = prefills[0].report
        assert first is not None
        self.scheduler.block_tokens = first.block_tokens or self.scheduler.block_tokens
        ns = namespace_of(prefills[0], req.tenant)
        keys = block_keys(ns, req.token_ids)  # once per request: they travel in the plan
        demand = Demand(keys if req.use_prefix_cache else [], len(req.token_ids),
                        max(1, req.max_tokens),
                        getattr(req, "priority", "interactive"))
        dec = self.scheduler.decide(demand, [self._prefill_view(p) for p in prefills],
                                    [self._decode_view(d) for d in decodes],
                                    time.monotonic() * 1000.0)
        if self.metrics is not None and math.isfinite(dec.verdict.headroom_ms):
            self.metrics.ttft_headroom.set(dec.verdict.headroom_ms)
        if not dec.admitted:
            if self.metrics is not None:
                self.metrics.rejections.labels(f"slo_{dec.verdict.reason}").inc()
            raise Overloaded(dec.verdict, demand.priority)
        prefill = prefills[dec.prefill]
        decode = decodes[dec.decode]
        if (prefill.report and decode.report
                and decode.report.revision != prefill.report.revision):
            decode = pick_decode(decodes, prefill, len(req.token_ids) + req.max_tokens)
        if dec.replicate and dec.fetch_blocks:
            self._pin(keys[: dec.local_blocks + dec.fetch_blocks])
        return Route(prefill, decode, dec.local_blocks + dec.fetch_blocks, tuple(keys),
                     ns.digest().hex(), dec.local_blocks)

    def _pin(self, keys: list[str]) -> None:
        if self.store is None or not keys or keys[-1] in self._pinned:
            return
        self._pinned[keys[-1]] = None
        while len(self._pinned) > self._pin_memory:
            self._pinned.popitem(last=False)
        store = self.store

        def pin() -> None:
            try:
                store.pin(keys)
            except Exception as e:  # a failed pin costs future hits, never this request
                log.debug("pinning a hot prefix failed", extra={"error": str(e)})

        asyncio.get_running_loop().run_in_executor(None, pin)
