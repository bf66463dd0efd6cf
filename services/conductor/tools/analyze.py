"""Does KV caching pay for this workload? The reuse analyzer behind `mooncake analyze`.

From a request trace alone (block ids per prompt, as in the Mooncake traces) it answers:

- hit rate vs cache capacity, for an LRU cache of prefix blocks, split into a DRAM tier and an
  SSD tier behind it (DRAM victims spill to SSD, so the two tiers are one LRU stack whose top
  part is DRAM);
- how reuse is distributed: how often each block is reused, how far apart (in cache capacity
  and in seconds) reuses are;
- for a model shape (KV bytes per token, prefill cost) and a link bandwidth, the predicted
  TTFT saving from loading cached prefixes instead of recomputing them, and the break-even
  bandwidth below which loading is slower than recomputing.

Method. Every block access gets an LRU *stack distance*: how many distinct blocks were used
since this block was last used. An LRU cache of C blocks hits exactly the accesses with
distance < C, so one pass gives the whole curve (Mattson et al., 1970). A request's blocks are
looked up first, then inserted tail-first, so a prefix block is always more recent than the
blocks after it: a cache never holds a block without its prefix, and the hits of a request are
exactly its leading blocks with distance < C (a prefix cache that evicts tails first; the
store's plain LRU can only do worse). Distances are counted with a Fenwick tree over access
times: O(log n) per access.

The TTFT figures are compute-only (no queueing, which only makes savings larger under load).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_k8s.conductor.sched.costmodel import CostModel, Prefill
from mooncake_k8s.conductor.tools.sim.trace import TraceRequest

INF = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Distances:
    dist: np.ndarray
    """Per access: stack distance in blocks (INF for a first access)."""
    tokens: np.ndarray
    """Per access: the prompt tokens its hit would save."""
    request: np.ndarray
    """Per access: the request's index."""
    gap_ms: np.ndarray
    """Per reuse (finite distance): time since the block's previous use."""
    reuse_counts: np.ndarray
    """Per distinct block: how many times it was reused after its first use."""


def stack_distances(reqs: Sequence[TraceRequest], block_tokens: int) -> Distances:
    total = sum(len(r.blocks) for r in reqs)
    tree = [0] * (total + 1)
    last: dict[int, int] = {}
    last_ms: dict[int, float] = {}
    uses: Counter[int] = Counter()
    dist = np.empty(total, dtype=np.int64)
    toks = np.empty(total, dtype=np.int64)
    owner = np.empty(total, dtype=np.int64)
    gaps: list[float] = []
    active = 0
    clock = 0
    pos = 0
    for ri, r in enumerate(reqs):
        blocks = r.blocks
        n = len(blocks)
        # What a hit on block i saves: its tokens, minus the one token always computed.
        budget = r.input_tokens - 1
        for i, b in enumerate(blocks):
            t = last.get(b)
            if t is None:
                dist[pos] = INF
            else:
                s, j = 0, t  # markers at times <= t
                while j > 0:
                    s += tree[j]
                    j -= j & -j
                dist[pos] = active - s
                gaps.append(r.arrival_ms - last_ms[b])
                uses[b] += 1
            toks[pos] = max(0, min(block_tokens, budget - i * block_tokens))
            owner[pos] = ri
            pos += 1
        for b in reversed(blocks):
            t = last.get(b)
            if t is not None:
                j = t
                while j <= total:
                    tree[j] -= 1
                    j += j & -j
            else:
                active += 1
                uses.setdefault(b, 0)
            clock += 1
            j = clock
            while j <= total:
                tree[j] += 1
                j += j & -j
            last[b] = clock
            last_ms[b] = r.arrival_ms
        del n
    return Distances(dist, toks, owner, np.asarray(gaps, dtype=np.float64),
                     np.fromiter(uses.values(), dtype=np.int64, count=len(uses)))


@dataclass(frozen=True)
class Options:
    block_tokens: int
    dram_tokens: int
    ssd_tokens: int
    model: CostModel
    bandwidth_gbps: float
    """The link cached KV is loaded over (DRAM tier)."""
    ssd_gbps: float
    prefill_ms_per_token: float | None = None
    """A linear prefill model instead of the cost model's (a model shape given by hand)."""


def _prefill(opts: Options) -> Prefill:
    if opts.prefill_ms_per_token is not None:
        return Prefill(0.0, opts.prefill_ms_per_token, 0.0)
    return opts.model.prefill


def analyze(reqs: Sequence[TraceRequest], opts: Options, points: int = 40) -> dict[str, Any]:
    bt = opts.block_tokens
    d = stack_distances(reqs, bt)
    prompt_tokens = int(sum(r.input_tokens for r in reqs))
    unique = int(d.reuse_counts.size)
    finite = d.dist < INF
    order = np.argsort(d.dist[finite], kind="stable")
    sdist = d.dist[finite][order]
    cum = np.concatenate(([0], np.cumsum(d.tokens[finite][order])))

    def hit_tokens(cap_blocks: float) -> int:
        return int(cum[np.searchsorted(sdist, cap_blocks, side="left")])

    top = max(unique, 1)
    caps = sorted({max(1, round(x)) for x in np.geomspace(1, top, points)})
    curve = [{"capacity_tokens": c * bt, "capacity_blocks": c,
              "hit_rate": round(hit_tokens(c) / prompt_tokens, 5)} for c in caps]
    dram_b = opts.dram_tokens // bt
    ssd_b = opts.ssd_tokens // bt
    dram_hit = hit_tokens(dram_b)
    ssd_hit = hit_tokens(dram_b + ssd_b) - dram_hit
    ideal = int(cum[-1])

    # Per request: tokens hit in each tier, at the configured capacities.
    n = len(reqs)
    in_dram = finite & (d.dist < dram_b)
    in_ssd = finite & (d.dist >= dram_b) & (d.dist < dram_b + ssd_b)
    h_dram = np.bincount(d.request[in_dram], weights=d.tokens[in_dram], minlength=n)
    h_ssd = np.bincount(d.request[in_ssd], weights=d.tokens[in_ssd], minlength=n)
    prompt = np.asarray([r.input_tokens for r in reqs], dtype=np.float64)
    ttft = _ttft(prompt, h_dram, h_ssd, opts)

    used = d.reuse_counts
    buckets = [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 63), (64, 255), (256, INF)]
    reuse_hist = [{"reuses": f"{lo}" if lo == hi else (f"{lo}+" if hi == INF else f"{lo}-{hi}"),
                   "blocks": int(((used >= lo) & (used <= hi)).sum())} for lo, hi in buckets]
    q = (50, 90, 99)
    return {
        "trace": {"requests": n, "prompt_tokens": prompt_tokens, "block_tokens": bt,
                  "blocks": int(d.dist.size), "unique_blocks": unique,
                  "unique_tokens": unique * bt,
                  "span_s": round((reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000, 1)},
        "curve": curve,
        "ideal_hit_rate": round(ideal / prompt_tokens, 5),
        "tiers": {"dram_tokens": opts.dram_tokens, "ssd_tokens": opts.ssd_tokens,
                  "dram_hit_rate": round(dram_hit / prompt_tokens, 5),
                  "ssd_hit_rate": round(ssd_hit / prompt_tokens, 5),
                  "hit_rate": round((dram_hit + ssd_hit) / prompt_tokens, 5)},
        "reuse": {
            "reuses": int(finite.sum()),
            "blocks_by_reuse_count": reuse_hist,
            "distance_tokens": {f"p{p}": int(np.percentile(sdist, p)) * bt if sdist.size
                                else None for p in q},
            "gap_s": {f"p{p}": round(float(np.percentile(d.gap_ms, p)) / 1000, 1)
                      if d.gap_ms.size else None for p in q},
        },
        "model": {"name": opts.model.name, "kv_bytes_per_token": opts.model.kv_bytes_per_token,
                  "prefill_ms_per_token": opts.prefill_ms_per_token,
                  "bandwidth_gbps": opts.bandwidth_gbps, "ssd_gbps": opts.ssd_gbps},
        "ttft": ttft,
        "break_even_gbps": ttft["break_even_gbps"],
    }


def _ttft(prompt: np.ndarray, h_dram: np.ndarray, h_ssd: np.ndarray,
          opts: Options) -> dict[str, Any]:
    pf = _prefill(opts)
    kv = opts.model.kv_bytes_per_token
    h = h_dram + h_ssd
    cold = _prefill_ms(pf, prompt, np.zeros_like(prompt))
    warm = _prefill_ms(pf, prompt - h, h)
    saved_compute = cold - warm
    load = h_dram * kv / (opts.bandwidth_gbps * 1e6) + h_ssd * kv / (opts.ssd_gbps * 1e6)
    with_cache = warm + load
    total_bytes = float((h * kv).sum())
    total_saved = float(saved_compute.sum())
    # The bandwidth at which loading every hit costs exactly the compute it saves.
    be = total_bytes / (total_saved * 1e6) if total_saved > 0 else math.inf
    hit = h > 0
    per_req = (h[hit] * kv) / (saved_compute[hit] * 1e6) if hit.any() else np.zeros(0)

    def curve_at(gbps: float) -> float:
        ld = h * kv / (gbps * 1e6)
        return float((cold - (warm + ld)).mean())

    bws = [1, 2, 5, 10, 25, 50, 100, 200, 400]
    return {
        "mean_ms_without_cache": round(float(cold.mean()), 1),
        "mean_ms_with_cache": round(float(with_cache.mean()), 1),
        "mean_saving_ms": round(float((cold - with_cache).mean()), 1),
        "saving_share": round(float((cold - with_cache).sum() / cold.sum()), 4)
        if cold.sum() else 0.0,
        "break_even_gbps": round(be, 3) if math.isfinite(be) else None,
        "break_even_gbps_per_request": {
            f"p{p}": round(float(np.percentile(per_req, p)), 3) if per_req.size else None
            for p in (50, 90)},
        "saving_vs_bandwidth": [{"gbps": g, "mean_saving_ms": round(curve_at(g), 1)}
                                for g in bws],
    }


def _prefill_ms(pf: Prefill, new: np.ndarray, cached: np.ndarray) -> np.ndarray:
    out = pf.base_ms + pf.per_token_ms * new + pf.attn_ms * new * (cached + new / 2)
    return np.where(new > 0, out, 0.0)


def report(result: dict[str, Any]) -> str:
    """The text table `mooncake analyze` prints."""
    t, tiers, reuse, tt = result["trace"], result["tiers"], result["reuse"], result["ttft"]
    lines = [
        f"trace: {t['requests']} requests over {t['span_s']} s, {t['prompt_tokens']:,} prompt "
        f"tokens, {t['unique_blocks']:,} distinct {t['block_tokens']}-token blocks "
        f"({t['unique_tokens']:,} tokens)",
        f"ideal hit rate (unbounded cache): {result['ideal_hit_rate']:.3f}",
        "",
        "capacity (tokens)   hit rate",
    ]
    curve = result["curve"]
    step = max(1, len(curve) // 12)
    for row in curve[::step] + ([curve[-1]] if (len(curve) - 1) % step else []):
        lines.append(f"{row['capacity_tokens']:>17,}   {row['hit_rate']:.3f}")
    lines += [
        "",
        f"tiers: DRAM {tiers['dram_tokens']:,} tokens -> hit {tiers['dram_hit_rate']:.3f}; "
        f"+ SSD {tiers['ssd_tokens']:,} tokens -> +{tiers['ssd_hit_rate']:.3f} "
        f"(total {tiers['hit_rate']:.3f})",
        f"reuses: {reuse['reuses']:,}; reuse distance (tokens of cache needed) "
        + ", ".join(f"{k} {v:,}" for k, v in reuse["distance_tokens"].items() if v is not None)
        + "; time between reuses (s) "
        + ", ".join(f"{k} {v}" for k, v in reuse["gap_s"].items() if v is not None),
        "blocks by reuse count: " + ", ".join(f"{b['reuses']}: {b['blocks']:,}"
                                               for b in reuse["blocks_by_reuse_count"]),
        "",
        f"model {result['model']['name']}: {result['model']['kv_bytes_per_token']:,} KV "
        f"bytes/token, link {result['model']['bandwidth_gbps']} GB/s "
        f"(SSD {result['model']['ssd_gbps']} GB/s)",
        f"prefill TTFT (compute only): {tt['mean_ms_without_cache']:.0f} ms without cache -> "
        f"{tt['mean_ms_with_cache']:.0f} ms with it (saving {tt['mean_saving_ms']:.0f} ms, "
        f"{tt['saving_share']:.1%})",
        f"break-even bandwidth: {tt['break_even_gbps']} GB/s (below it, loading cached KV "
        f"is slower than recomputing it); per request p50 "
        f"{tt['break_even_gbps_per_request']['p50']} GB/s, p90 "
        f"{tt['break_even_gbps_per_request']['p90']} GB/s",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Hit rate vs capacity (tiers marked) and saving vs bandwidth, as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the plot needs matplotlib: pip install 'mooncake-k8s[analyze]'") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    curve = result["curve"]
    a.plot([c["capacity_tokens"] for c in curve], [c["hit_rate"] for c in curve], marker=".")
    a.axhline(result["ideal_hit_rate"], ls=":", c="gray", label="unbounded cache")
    tiers = result["tiers"]
    a.axvline(tiers["dram_tokens"], ls="--", c="tab:green",
              label=f"DRAM {tiers['dram_tokens']:,} tok: {tiers['dram_hit_rate']:.2f}")
    if tiers["ssd_tokens"]:
        a.axvline(tiers["dram_tokens"] + tiers["ssd_tokens"], ls="--", c="tab:orange",
                  label=f"+SSD {tiers['ssd_tokens']:,} tok: {tiers['hit_rate']:.2f}")
    a.set_xscale("log")
    a.set_xlabel("cache capacity (tokens, LRU)")
    a.set_ylabel("prompt tokens served from cache")
    a.set_title("Hit rate vs capacity")
    a.legend(fontsize=8)
    sv = result["ttft"]["saving_vs_bandwidth"]
    b.plot([s["gbps"] for s in sv], [s["mean_saving_ms"] for s in sv], marker="o")
    b.axhline(0, c="gray", lw=0.8)
    be = result["ttft"]["break_even_gbps"]
    if be:
        b.axvline(be, ls="--", c="tab:red", label=f"break-even {be:.2f} GB/s")
        b.legend(fontsize=8)
    b.set_xscale("log")
    b.set_xlabel("link bandwidth (GB/s)")
    b.set_ylabel("mean TTFT saving per request (ms)")
    b.set_title(f"Saving for {result['model']['name']} (compute only)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
