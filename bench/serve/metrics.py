"""Per-request records -> the numbers `vllm bench serve` reports, under the same keys.

Keeping vLLM's names and definitions (checked against `vllm/benchmarks/serve.py`) means our
JSON can be read by the tools and habits people already have, and numbers from the two can be
put side by side:

- `completed`, `failed`, `total_input_tokens`, `total_output_tokens`, `duration` (s)
- `request_throughput` = completed / duration; `output_throughput` and
  `total_token_throughput` (input + output) in tokens/s over the same duration
- `request_goodput` = requests meeting every `--goodput` SLO / duration (None without SLOs);
  a request with one output token has TPOT 0 for this purpose, as in vLLM
- `mean_/median_/std_/p{P}_{ttft,tpot,itl,e2el}_ms`; TPOT = (e2el - ttft) / (output - 1) over
  requests with more than one output token; ITL pools every gap of every request
- empty lists give 0.0 (vLLM does the same), so `completed` is what says a number is empty

Ours on top: `rejected` (HTTP 429s, also counted in `failed`), `errors` (the first few
distinct messages), `prefix_cache_hit_rate` (cached / prompt tokens from each response's
`usage`), the same rate from the server's Prometheus counters as a cross-check, and
`max_concurrent_requests` (peak requests in flight).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.serve.client import RequestOutput

SLO_NAMES = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS = 5
PROM_PROMPT = "mooncake_conductor_prompt_tokens_total"
PROM_CACHED = "mooncake_conductor_prompt_tokens_cached_total"


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        for item in pair.replace(",", " ").split():
            name, sep, value = item.partition(":")
            if not sep:
                raise ValueError(f"--goodput wants NAME:MS pairs, got {item!r}")
            if name not in SLO_NAMES:
                raise ValueError(f"--goodput metric {name!r} is not one of {', '.join(SLO_NAMES)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {name}: {value!r} is not a number") from None
            if ms < 0:
                raise ValueError(f"--goodput {name}: SLO must be >= 0 ms")
            slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0]; each in (0, 100]."""
    values = []
    for item in text.split(","):
        if not item.strip():
            continue
        p = float(item)
        if not 0 < p <= 100:
            raise ValueError(f"percentile {p} is not in (0, 100]")
        values.append(p)
    return values


def p_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": the key spelling vLLM uses (`p99_ttft_ms`)."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: list[float], percentiles: Iterable[float]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p_word(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def tpot_of(o: RequestOutput) -> float:
    """Seconds per output token after the first; 0 for a single-token answer."""
    if o.output_tokens > 1:
        return (o.latency - o.ttft) / (o.output_tokens - 1)
    return 0.0


def peak_concurrency(outputs: Iterable[RequestOutput]) -> int:
    """Most requests in flight at once, from half-open [start, start + latency) intervals."""
    events = []
    for o in outputs:
        events.append((o.start, 1))
        events.append((o.start + o.latency, -1))
    events.sort()  # at equal times -1 sorts before +1: an end frees its slot first
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def compute(outputs: Sequence[RequestOutput], duration_s: float, *,
            percentiles: Sequence[float] = (99.0,),
            percentile_metrics: Sequence[str] = LATENCY_METRICS,
            goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The vLLM-style result dict for one run (see the module docstring for every key)."""
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    tpots = [tpot_of(o) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]

    good = None
    if goodput:
        good = 0
        for o in ok:
            measured = {"ttft": o.ttft, "tpot": tpot_of(o), "e2el": o.latency}
            if all(measured[k] * 1e3 <= slo for k, slo in goodput.items()):
                good += 1

    with_usage = [o for o in ok if o.cached_tokens is not None]
    cached = sum(o.cached_tokens or 0 for o in with_usage)
    prompt_with_usage = sum(o.prompt_len for o in with_usage)
    errors: list[str] = []
    for o in failed:
        if o.error not in errors:
            errors.append(o.error)
        if len(errors) >= MAX_ERRORS:
            break

    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "rejected": sum(1 for o in failed if o.rejected),
        "errors": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": None if good is None else good / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_concurrent_requests": peak_concurrency(ok),
        "total_cached_tokens": cached if with_usage else None,
        "prefix_cache_hit_rate": (cached / prompt_with_usage) if prompt_with_usage else None,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in LATENCY_METRICS:
        if name in percentile_metrics:
            result.update(_stats(name, series[name], percentiles))
    return result


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def prom_counters(text: str | None, names: Iterable[str]) -> dict[str, float]:
    """Sum of every sample of each named metric in a Prometheus text exposition."""
    wanted = set(names)
    sums = dict.fromkeys(wanted, 0.0)
    for line in (text or "").splitlines():
        m = _PROM_LINE.match(line)
        if m and m.group(1) in wanted:
            try:
                sums[m.group(1)] += float(m.group(3))
            except ValueError:
                continue
    return sums


def prom_hit_rate(before: str | None, after: str | None) -> dict[str, Any]:
    """Server-side cached/prompt tokens over the run, from two scrapes of `/metrics`."""
    if before is None or after is None:
        return {"metrics_prefix_cache_hit_rate": None}
    a = prom_counters(after, (PROM_PROMPT, PROM_CACHED))
    b = prom_counters(before, (PROM_PROMPT, PROM_CACHED))
    prompt = a[PROM_PROMPT] - b[PROM_PROMPT]
    cached = a[PROM_CACHED] - b[PROM_CACHED]
    return {"metrics_prompt_tokens": prompt, "metrics_cached_tokens": cached,
            "metrics_prefix_cache_hit_rate": (cached / prompt) if prompt > 0 else None}
