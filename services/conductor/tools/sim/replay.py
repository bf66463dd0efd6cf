"""Replaying a trace against a simulated cluster with the real scheduler, policy by policy.

The event loop has two kinds of events, a request's arrival and a prefill instance finishing
its job; decode instances are advanced lazily to each event's time. At an arrival the
scheduler sees what the live Conductor sees: each prefill instance's predicted queue (from the
cost model, as a load report would give it), each decode instance's running batch and reserved
KV, and the KV index as the block events left it. Everything random is drawn from `seed`, and
ties break by instance order, so a replay is deterministic.

Metrics follow the paper: TTFT from arrival to the first token (prefill's), TBT as the mean of a
request's slowest 10% of token intervals, and the effective request capacity as the share of
*all* requests (rejected ones included) that met both SLOs.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig
from mooncake_k8s.conductor.sched.costmodel import CostModel
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import (
    POLICIES,
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
)
from mooncake_k8s.conductor.tools.sim.cluster import DecodeSim, Job, PrefillSim, tbt_of
from mooncake_k8s.conductor.tools.sim.trace import TraceRequest

_ARRIVE, _PREFILLED = 0, 1


@dataclass(frozen=True)
class ReplaySetup:
    """The simulated cluster and workload; reported verbatim next to the results."""

    prefill_instances: int = 8
    decode_instances: int = 8
    block_tokens: int = 512
    local_cache_tokens: int = 3_000_000
    """Each prefill instance's local DRAM KV cache (the paper's ~1 TB per node)."""
    decode_kv_tokens: int = 0
    """0 = the cost model's decode capacity."""
    ttft_slo_ms: float = 30_000.0
    tbt_slo_ms: float = 100.0
    rate_scale: float = 1.0
    """Arrival rate multiplier: timestamps are divided by it."""
    noise: float = 0.0
    """Sigma of a lognormal factor on each prefill's compute time (prediction error)."""
    seed: int = 0
    profile: str = ""
    requests: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    policy: str
    early_rejection: bool
    requests: int
    effective: int
    rejected: int
    ttft_ms: np.ndarray
    tbt_ms: np.ndarray
    prompt_tokens: int
    cached_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        t = self.ttft_ms
        has = t.size > 0
        return {
            "policy": self.policy,
            "early_rejection": self.early_rejection,
            "effective_capacity": round(self.effective / self.requests, 4),
            "ttft_mean_ms": round(float(t.mean()), 1) if has else None,
            "ttft_p90_ms": round(float(np.percentile(t, 90)), 1) if has else None,
            "ttft_p99_ms": round(float(np.percentile(t, 99)), 1) if has else None,
            "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens else 0.0,
            "rejected": self.rejected,
            "tbt_mean_ms": round(float(self.tbt_ms.mean()), 1) if self.tbt_ms.size else None,
            "tbt_p99_ms": round(float(np.percentile(self.tbt_ms, 99)), 1)
            if self.tbt_ms.size else None,
            **self.extra,
        }


def run(reqs: Sequence[TraceRequest], setup: ReplaySetup, model: CostModel, policy: str,
        early_rejection: bool) -> RunResult:
    """Replay `reqs` under one policy; deterministic for a given setup."""
    started = time.perf_counter()
    index = KVIndex()
    slo = SLO(setup.ttft_slo_ms, setup.tbt_slo_ms)
    sched = Scheduler(SchedulerConfig(
        policy=policy, block_tokens=setup.block_tokens,
        admission=AdmissionConfig(slo) if early_rejection else None, seed=setup.seed,
    ), model, index)
    cap_blocks = max(1, setup.local_cache_tokens // setup.block_tokens)
    prefills = [PrefillSim(i, model, index, cap_blocks, setup.block_tokens, setup.noise,
                           setup.seed + 1 + i) for i in range(setup.prefill_instances)]
    dcap = setup.decode_kv_tokens or model.decode.kv_capacity_tokens or (1 << 62)
    decodes = [DecodeSim(i, model, dcap) for i in range(setup.decode_instances)]
    n = len(reqs)
    ttft = np.full(n, np.nan)
    cached = np.zeros(n, dtype=np.int64)
    where = np.full(n, -1, dtype=np.int64)
    rejected = 0
    fetched = 0
    events: list[tuple[float, int, int, int]] = []
    scale = setup.rate_scale
    for i, r in enumerate(reqs):
        events.append((r.arrival_ms / scale, _ARRIVE, i, 0))
    heapq.heapify(events)
    seq = n
    handoff: Callable[[str, int], float] = model.transfer_ms
    while events:
        now, kind, rid, slot = heapq.heappop(events)
        if kind == _ARRIVE:
            r = reqs[rid]
            for d in decodes:
                d.advance(now)
            pv = [PrefillView(p.slot, p.queue_ms(now), p.mask) for p in prefills]
            dv = [DecodeView(d.slot, d.running, d.reserved, d.capacity) for d in decodes]
            dec = sched.decide(Demand(r.blocks, r.input_tokens, r.output_tokens), pv, dv, now)
            if not dec.admitted:
                rejected += 1
                continue
            p = prefills[dec.prefill]
            where[rid] = dec.decode
            predicted = dec.ttft_ms - pv[dec.prefill].queue_ms
            fin = p.submit(Job(rid, now, r.blocks, r.input_tokens,
                               dec.local_blocks + dec.fetch_blocks, dec.replicate, predicted),
                           now)
            if fin is not None:
                heapq.heappush(events, (fin, _PREFILLED, seq, p.slot))
                seq += 1
        else:
            p = prefills[slot]
            job, done, nxt = p.finish(now)
            if nxt is not None:
                heapq.heappush(events, (nxt, _PREFILLED, seq, p.slot))
                seq += 1
            r = reqs[job.rid]
            ttft[job.rid] = now - job.arrival_ms
            cached[job.rid] = done.cached_tokens
            fetched += done.fetched_blocks
            d = decodes[int(where[job.rid])]
            d.advance(now)
            # KV streams to decode layer by layer while prefill computes, so only the part of
            # the transfer that outlasts the computation delays decode.
            lag = max(0.0, handoff("decode", r.input_tokens) - done.compute_ms)
            d.push(now + lag, job.rid, now, r.output_tokens - 1,
                   r.input_tokens, r.input_tokens + r.output_tokens)
    tbt = np.zeros(n)
    max_batch = 0
    for d in decodes:
        d.advance(math.inf)
        durs, ends = d.step_series()
        for rid, (first, steps, t1) in d.joins.items():
            tbt[rid] = tbt_of(durs, ends, first, steps, t1)
        max_batch = max(max_batch, d.max_batch)
    done_mask = ~np.isnan(ttft)
    ok = done_mask & (ttft <= slo.ttft_ms if slo.ttft_ms else True) & (
        tbt <= slo.tbt_ms if slo.tbt_ms else True)
    prompt = int(sum(r.input_tokens for r, m in zip(reqs, done_mask, strict=True) if m))
    busy = [p.busy_ms for p in prefills]
    horizon = max((r.arrival_ms for r in reqs), default=0.0) / scale
    return RunResult(
        policy, early_rejection, n, int(ok.sum()), rejected, ttft[done_mask], tbt[done_mask],
        prompt, int(cached[done_mask].sum()),
        extra={
            "ttft_slo_met": round(float((ttft[done_mask] <= slo.ttft_ms).mean()), 4)
            if slo.ttft_ms and done_mask.any() else None,
            "tbt_slo_met": round(float((tbt[done_mask] <= slo.tbt_ms).mean()), 4)
            if slo.tbt_ms and done_mask.any() else None,
            "fetched_blocks": fetched,
            "replicated_blocks": sum(p.replicated_blocks for p in prefills),
            "evicted_blocks": sum(p.evictions for p in prefills),
            "prefill_busy_share": round(sum(busy) / (len(busy) * horizon), 3) if horizon else None,
            "max_decode_batch": max_batch,
            "sim_seconds": round(time.perf_counter() - started, 2),
        })


def run_all(reqs: Sequence[TraceRequest], setup: ReplaySetup, model: CostModel,
            policies: Sequence[str] = POLICIES, early_rejection: Sequence[bool] = (False, True),
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every (policy, early rejection) pair: `{"setup": ..., "rows": [...]}`."""
    rows = []
    for er in early_rejection:
        for pol in policies:
            res = run(reqs, setup, model, pol, er)
            rows.append(res.row())
            if progress:
                progress(f"{pol}{' +ER' if er else ''}: {res.row()['effective_capacity']:.3f} "
                         f"effective, TTFT mean {res.row()['ttft_mean_ms']} ms "
                         f"({res.extra['sim_seconds']} s)")
    setup = replace(setup, requests=len(reqs), profile=setup.profile or model.name)
    return {"setup": {**setup.to_json(), "cost_model": model.to_dict()}, "rows": rows}


COLUMNS = [("policy", "policy", "{}"), ("early_rejection", "ER", "{}"),
           ("effective_capacity", "effective", "{:.3f}"), ("ttft_mean_ms", "TTFT mean ms",
                                                          "{:.0f}"),
           ("ttft_p90_ms", "p90 ms", "{:.0f}"), ("ttft_p99_ms", "p99 ms", "{:.0f}"),
           ("tbt_p99_ms", "TBT p99 ms", "{:.1f}"), ("hit_rate", "hit rate", "{:.3f}"),
           ("rejected", "rejected", "{}")]


def table(rows: Sequence[dict[str, Any]], with_scale: bool = False) -> str:
    cols = ([("rate_scale", "rate", "x{}")] if with_scale else []) + COLUMNS
    head = [c[1] for c in cols]
    body = [[("-" if r.get(k) is None else f.format(r[k])) for k, _, f in cols]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(out)


_ORDER = ("global_cache_aware", "local_cache_aware", "load_balancing", "random")


def checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's two claims, per (rate, early rejection) group that has the policies:
    mean TTFT global < local < load-balancing < random (Fig. 5), and global-cache-aware's
    effective capacity over load-balancing's."""
    groups: dict[tuple[Any, bool], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("rate_scale", 1.0), r["early_rejection"]), {})[r["policy"]] = r
    out = []
    for (scale, er), g in groups.items():
        tag = f"x{scale}{' +ER' if er else ''}"
        if all(p in g for p in _ORDER):
            t = [g[p]["ttft_mean_ms"] for p in _ORDER]
            ok = all(a is not None and b is not None and a < b for a, b in itertools.pairwise(t))
            out.append({"rate_scale": scale, "early_rejection": er, "check": "ttft_order",
                        "ok": ok, "text": f"{tag}: TTFT mean global < local < load-balancing "
                        f"< random: {'yes' if ok else 'NO'} ({' / '.join(str(x) for x in t)})"})
        if "global_cache_aware" in g and "load_balancing" in g:
            lb = g["load_balancing"]["effective_capacity"]
            gl = g["global_cache_aware"]["effective_capacity"]
            ratio = gl / lb if lb else math.inf
            out.append({"rate_scale": scale, "early_rejection": er, "check": "capacity_ratio",
                        "ratio": round(ratio, 3), "ok": ratio >= 1.5,
                        "text": f"{tag}: effective capacity global / load-balancing = "
                        f"{gl:.3f} / {lb:.3f} = {ratio:.2f}x (target >= 1.5x)"})
    return out
