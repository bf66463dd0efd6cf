"""Plain-text (Markdown) tables for the serving benchmark's results.

Plain text on purpose: the tables are committed beside the script (`bench/results/`) and
pasted into issues, and the benchmark must run from a fresh install without extra packages.
The load table puts the cached deployment and the baseline side by side, one metric per row,
so the effect of the cache is read across a line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.serve.metrics import LATENCY_METRICS, p_word

_LOAD_ROWS: tuple[tuple[str, str, str], ...] = (
    ("completed", "Successful requests", "d"),
    ("failed", "Failed requests", "d"),
    ("rejected", "  of which rejected (429)", "d"),
    ("duration", "Benchmark duration (s)", ".2f"),
    ("total_input_tokens", "Total input tokens", "d"),
    ("total_output_tokens", "Total generated tokens", "d"),
    ("request_throughput", "Request throughput (req/s)", ".3f"),
    ("request_goodput", "Request goodput (req/s)", ".3f"),
    ("output_throughput", "Output token throughput (tok/s)", ".2f"),
    ("total_token_throughput", "Total token throughput (tok/s)", ".2f"),
    ("max_concurrent_requests", "Peak concurrent requests", "d"),
    ("prefix_cache_hit_rate", "Prefix cache hit rate (usage)", ".3f"),
    ("metrics_prefix_cache_hit_rate", "Prefix cache hit rate (/metrics)", ".3f"),
    ("ideal_prefix_cache_hit_rate", "Prefix cache hit rate (ideal)", ".3f"),
)
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if spec == "d":
        return str(int(value))
    return format(float(value), spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[bool] | None = None) -> str:
    """A Markdown table padded to the widest cell of each column."""
    right = right or [False] + [True] * (len(headers) - 1)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right,
                                                                  strict=True)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def reuse_table(rows: list[dict[str, Any]]) -> str:
    headers = ["prompt tokens", "cold TTFT ms", "hit TTFT ms", "hit/cold", "cached (hit)",
               "baseline cold ms", "baseline hit ms", "baseline hit/cold", "hit vs baseline"]
    body = []
    for r in rows:
        speedup = r.get("hit_speedup_vs_baseline")
        body.append([
            str(r["prompt_tokens"]), fmt(r.get("cold_ttft_ms")), fmt(r.get("hit_ttft_ms")),
            fmt(r.get("ratio"), ".3f"), fmt(r.get("hit_cached_tokens"), "d"),
            fmt(r.get("baseline_cold_ttft_ms")), fmt(r.get("baseline_hit_ttft_ms")),
            fmt(r.get("baseline_ratio"), ".3f"),
            "-" if speedup is None else f"{speedup:.1f}x",
        ])
    return table(headers, body)


def load_table(results: dict[str, dict[str, Any] | None], percentiles: Sequence[float],
               percentile_metrics: Sequence[str]) -> str:
    """One column per deployment ("cache", "baseline"), one row per metric."""
    cols = [(name, res) for name, res in results.items() if res is not None]
    body: list[list[str]] = []
    for key, label, spec in _LOAD_ROWS:
        if all(res.get(key) is None for _, res in cols) and key != "request_goodput":
            continue
        body.append([label, *(fmt(res.get(key), spec) for _, res in cols)])
    for m in LATENCY_METRICS:
        if m not in percentile_metrics:
            continue
        stats = ["mean", "median", "std"] + [f"p{p_word(p)}" for p in percentiles]
        for s in stats:
            key = f"{s}_{m}_ms"
            body.append([f"{s.capitalize() if not s.startswith('p') else s.upper()} "
                         f"{_NAMES[m]} (ms)", *(fmt(res.get(key), ".2f") for _, res in cols)])
    return table(["metric", *(name for name, _ in cols)], body)


def errors_block(results: dict[str, dict[str, Any] | None]) -> str:
    lines = []
    for name, res in results.items():
        for err in (res or {}).get("errors") or []:
            lines.append(f"  {name}: {err}")
    return ("first errors:\n" + "\n".join(lines)) if lines else ""
