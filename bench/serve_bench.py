#!/usr/bin/env python3
"""Serving benchmark: load generator and reuse table for the OpenAI endpoint.

Measures what a user of the endpoint feels (TTFT, TPOT, ITL, end-to-end latency, throughput,
goodput under SLOs) under a chosen load, and how much the KV cache saves, reporting the same
keys as `vllm bench serve` plus the prefix cache hit rate. Two parts:

  reuse table  (--reuse-table) prompts of 512/2048/4096 tokens: a cold prompt, then the same
               prompt again (a full-prefix hit); TTFT of each and hit/cold. Goal on the 2-core
               CPU box: hit/cold <= 0.05 at 2048 tokens.
  load         --num-prompts requests from a synthetic shared-prefix generator or a Mooncake
               JSONL trace, sent at --request-rate (Poisson; inf = all at once), under
               --max-concurrency, or at the trace's own times.

The baseline is the same deployment with the cache disabled (`mooncake up --no-prefix-cache`),
measured in the same run: by default the benchmark launches both deployments itself, one after
the other. With --base-url it measures a running server instead (and a baseline only if
--baseline-url names one).

Usage:
  python bench/serve_bench.py --quick --reuse-table                # launches both deployments
  python bench/serve_bench.py --base-url http://127.0.0.1:8000 --reuse-table --json out.json
  python bench/serve_bench.py --dataset trace --trace ../shared/traces/conversation_trace.jsonl \\
      --trace-scale 16 --trace-time-scale 4 --num-prompts 100 --goodput ttft:2000 tpot:200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

# Run as a script: make the `bench` package importable. Appended, not prepended, so the repo
# root (it holds an `operator/` directory) cannot shadow the standard library.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.serve import datasets, deploy, load, metrics, reuse
from bench.serve import report as rep
from bench.serve.client import ApiConfig

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_TRACE = BENCH_DIR.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
# (quick, full) defaults of the options left unset; sized for the 2-core CPU box, where a cold
# 2048-token prefill of the built-in model takes about 4 s.
PRESETS: dict[str, tuple[Any, Any]] = {
    "num_prompts": (12, 48),
    "prefix_len": (512, 1536),
    "suffix_len": (32, 128),
    "num_prefixes": (2, 4),
    "output_len": (8, 32),
    "max_concurrency": (2, 4),
    "reuse_repeats": (1, 3),
}


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Unset options take --quick/full defaults: "
               + ", ".join(f"{k}={q}/{f}" for k, (q, f) in PRESETS.items())
               + " (max_concurrency: none with --dataset trace)")
    g = p.add_argument_group("deployments")
    g.add_argument("--base-url", help="measure this running server (no launch), e.g. "
                                      "http://127.0.0.1:8000")
    g.add_argument("--baseline-url", help="with --base-url: a running baseline deployment")
    g.add_argument("--no-baseline", action="store_true",
                   help="skip the --no-prefix-cache baseline")
    g.add_argument("--mooncake-cmd", help="how to run the CLI when launching [default: this "
                                          "python -m mooncake_k8s.cli, else `mooncake`]")
    g.add_argument("--prefill", type=int, default=1, help="prefill instances when launching")
    g.add_argument("--decode", type=int, default=1, help="decode instances when launching")
    g.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `mooncake up` (repeatable), e.g. --up-arg=--threads=2")
    g.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds to wait for a launched deployment's /readyz")
    g.add_argument("--log-dir", help="where launched deployments log [default: a temp dir, "
                                     "deleted after a clean run]")
    g = p.add_argument_group("requests")
    g.add_argument("--model", help="model name [default: the first of GET /v1/models]")
    g.add_argument("--api-key", default=os.environ.get("MOONCAKE_API_KEY"),
                   help="Bearer key [env MOONCAKE_API_KEY]")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions sends token ids (exact lengths); chat sends word text")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests/s, Poisson arrivals; inf = all at once [default: inf, or the "
                        "trace's own timestamps with --dataset trace]")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (0 = unlimited)")
    g.add_argument("--num-prompts", type=int, default=None, help="requests in the load run "
                                                                 "(0 skips it)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (lengths then vary)")
    g = p.add_argument_group("datasets")
    g.add_argument("--dataset", choices=("synthetic", "trace"), default="synthetic")
    g.add_argument("--prefix-len", type=int, help="synthetic: shared prefix tokens")
    g.add_argument("--suffix-len", type=int, help="synthetic: unique tokens per request")
    g.add_argument("--num-prefixes", type=int, help="synthetic: distinct shared prefixes")
    g.add_argument("--output-len", type=int, help="synthetic: output tokens per request")
    g.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL trace")
    g.add_argument("--trace-scale", type=float, default=16.0,
                   help="divide the trace's input/output lengths (and its 512-token hash "
                        "blocks) by this")
    g.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival times by this (>1 = lighter load)")
    g.add_argument("--trace-start", type=int, default=0, help="first trace row to use")
    g.add_argument("--max-model-len", type=int,
                   help="context to fit trace prompts into [default: from /v1/models, else 8192]")
    g.add_argument("--vocab-size", type=int, default=datasets.DEFAULT_VOCAB)
    g.add_argument("--block-tokens", type=int, default=64,
                   help="the server's KV block size (only for the ideal hit rate)")
    g.add_argument("--seed", type=int, default=0, help="structure of the dataset, arrivals")
    g.add_argument("--salt", type=int, default=None,
                   help="content of the prompts [default: random per run, so nothing is "
                        "cached from an earlier run]")
    g = p.add_argument_group("reporting")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs for request_goodput, e.g. ttft:2000 tpot:100 e2el:10000")
    g.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--json", nargs="?", const="", metavar="OUT",
                   help="write JSON to OUT [default: bench/results/serve_bench-<time>.json]")
    g.add_argument("--save-detailed", action="store_true", help="per-request records in JSON")
    g = p.add_argument_group("reuse table")
    g.add_argument("--reuse-table", action="store_true", help="measure cold vs hit TTFT")
    g.add_argument("--reuse-sizes", default="512,2048,4096", help="prompt tokens, comma-separated")
    g.add_argument("--reuse-repeats", type=int, help="fresh prompts per size (median reported)")
    g.add_argument("--reuse-output-len", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a small run (defaults above)")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset sizes from the preset and check everything before anything starts."""
    for name, (quick, full) in PRESETS.items():
        if name == "max_concurrency" and args.dataset == "trace":
            continue  # a trace brings its own arrivals; a cap would reshape them
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.request_rate is None and args.dataset == "synthetic":
        args.request_rate = math.inf
    if args.salt is None:
        args.salt = datasets.new_salt()
    args.percentiles = metrics.parse_percentiles(args.metric_percentiles)
    args.pmetrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in args.pmetrics if m not in metrics.LATENCY_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from "
                         f"{','.join(metrics.LATENCY_METRICS)}")
    args.slos = metrics.parse_goodput(args.goodput)
    args.sizes = [int(s) for s in args.reuse_sizes.split(",") if s.strip()]
    if args.reuse_table and (not args.sizes or min(args.sizes) < 1):
        raise ValueError("--reuse-sizes needs positive token counts")
    for name in ("num_prompts", "prefix_len", "suffix_len", "reuse_repeats"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.output_len < 1 or args.reuse_output_len < 1:
        raise ValueError("--output-len and --reuse-output-len must be >= 1")
    if args.prefix_len + args.suffix_len < 1 and args.dataset == "synthetic":
        raise ValueError("a synthetic prompt needs --prefix-len + --suffix-len >= 1")
    if args.dataset == "trace" and args.num_prompts and not Path(args.trace).is_file():
        raise ValueError(f"--trace {args.trace}: no such file")
    if args.baseline_url and not args.base_url:
        raise ValueError("--baseline-url goes with --base-url")
    if args.max_concurrency == 0:
        args.max_concurrency = None
    return args


def build_dataset(args: argparse.Namespace, salt: int, max_model_len: int) -> datasets.Dataset:
    if args.dataset == "trace":
        return datasets.trace(args.trace, num_prompts=args.num_prompts, scale=args.trace_scale,
                              time_scale=args.trace_time_scale, start=args.trace_start,
                              max_model_len=max_model_len, seed=args.seed, salt=salt,
                              endpoint=args.endpoint, vocab=args.vocab_size)
    return datasets.synthetic(num_prompts=args.num_prompts, prefix_len=args.prefix_len,
                              suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                              output_len=args.output_len, seed=args.seed, salt=salt,
                              endpoint=args.endpoint, vocab=args.vocab_size,
                              block_tokens=args.block_tokens)


def measure(args: argparse.Namespace, target: deploy.Target, salt: int,
            state: dict[str, Any]) -> dict[str, Any]:
    """Reuse table then load run on one deployment; returns {"reuse", "load", "server"}."""
    server = asyncio.run(deploy.discover(target.base_url, args.api_key))
    model = args.model or server["model"]
    ctx = args.max_model_len or server["max_model_len"] or 8192
    log(f"{target.label}: {target.base_url} serves {server['model']!r}, context {ctx}")
    api = ApiConfig(base_url=target.base_url, model=model, endpoint=args.endpoint,
                    api_key=args.api_key, timeout_s=args.request_timeout,
                    ignore_eos=not args.no_ignore_eos)
    out: dict[str, Any] = {"server": {**server, "base_url": target.base_url,
                                      "launched": target.launched, "log": target.log_path}}
    if args.reuse_table:
        log(f"{target.label}: reuse table {args.sizes} x {args.reuse_repeats}")
        out["reuse"] = asyncio.run(reuse.measure(
            api, args.sizes, repeats=max(1, args.reuse_repeats), output_len=args.reuse_output_len,
            max_model_len=ctx, vocab=args.vocab_size, log=log))
    if args.num_prompts:
        ds = build_dataset(args, salt, ctx)
        state.setdefault("dataset", ds.info)
        rate = "trace times" if args.request_rate is None else args.request_rate
        log(f"{target.label}: load, {len(ds.requests)} requests, rate {rate}, "
            f"max concurrency {args.max_concurrency}")
        before = asyncio.run(deploy.scrape(target.base_url))
        outputs, duration = asyncio.run(load.run(api, ds.requests, load.LoadConfig(
            request_rate=args.request_rate, max_concurrency=args.max_concurrency,
            seed=args.seed), label=target.label))
        after = asyncio.run(deploy.scrape(target.base_url))
        res = metrics.compute(outputs, duration, percentiles=args.percentiles,
                              percentile_metrics=args.pmetrics, goodput=args.slos)
        res.update(metrics.prom_hit_rate(before, after))
        res["ideal_prefix_cache_hit_rate"] = ds.info.get("ideal_prefix_cache_hit_rate")
        res["request_rate"] = args.request_rate if args.request_rate is not None else "trace"
        res["max_concurrency"] = args.max_concurrency
        if args.save_detailed:
            res["requests"] = [o.to_json() for o in outputs]
        out["load"] = res
    return out


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so `finally` blocks stop launched deployments."""
    def handler(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def targets(args: argparse.Namespace, log_dir: Path) -> list[tuple[str, Any]]:
    """(label, context manager yielding a Target) for the cached run and the baseline."""
    if args.base_url:
        out: list[tuple[str, Any]] = [("cache", deploy.attach("cache", args.base_url))]
        if args.baseline_url and not args.no_baseline:
            out.append(("baseline", deploy.attach("baseline", args.baseline_url)))
        return out
    cmd = shlex.split(args.mooncake_cmd) if args.mooncake_cmd else deploy.default_command()
    up = ["--prefill", str(args.prefill), "--decode", str(args.decode), *args.up_arg]
    kw = {"command": cmd, "log_dir": log_dir, "ready_timeout_s": args.ready_timeout}
    out = [("cache", deploy.launch("cache", up_args=up, **kw))]
    if not args.no_baseline:
        out.append(("baseline", deploy.launch("baseline", up_args=[*up, "--no-prefix-cache"],
                                              **kw)))
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
    return {"host": platform.node(), "cpu": cpu, "nproc": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "git_commit": commit}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = resolve(args)
    except ValueError as e:
        parser.error(str(e))
    started = dt.datetime.now().astimezone()
    t0 = time.monotonic()
    own_logs = args.log_dir is None and not args.base_url
    log_dir = Path(args.log_dir or (tempfile.mkdtemp(prefix="serve_bench_") if own_logs else "."))
    runs: dict[str, dict[str, Any] | None] = {}
    problems: dict[str, str] = {}
    state: dict[str, Any] = {}
    try:
        with sigterm_as_interrupt():
            for i, (label, ctx) in enumerate(targets(args, log_dir)):
                try:
                    with ctx as target:
                        # The baseline's prompts have the same shapes, other bytes: it can
                        # never be handed a prefix the cached run stored.
                        runs[label] = measure(args, target, args.salt + i, state)
                except (RuntimeError, OSError, ValueError, aiohttp.ClientError) as e:
                    problems[label] = str(e)
                    runs[label] = None
                    log(f"UNAVAILABLE {label}: {e}")
                    if label == "cache":
                        break
    except KeyboardInterrupt:
        log("interrupted; deployments stopped" + (f", logs in {log_dir}" if own_logs else ""))
        return 130
    cache, base = runs.get("cache"), runs.get("baseline")
    result: dict[str, Any] = {}
    if cache and "reuse" in cache:
        rows = cache["reuse"]
        reuse.merge_baseline(rows, (base or {}).get("reuse"))
        result["reuse"] = rows
        result["reuse_goal"] = reuse.goal(rows)
    if cache and "load" in cache:
        result.update({k: v for k, v in cache["load"].items() if k != "requests"})
        result["load"] = cache["load"]
    result["baseline"] = (base or {}).get("load")
    if base and "reuse" in base:
        result["baseline_reuse"] = base["reuse"]
    safe_args = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    safe_args["api_key"] = "***" if args.api_key else None
    result["meta"] = {
        "date": started.isoformat(timespec="seconds"), "wall_s": round(time.monotonic() - t0, 1),
        "machine": machine(), "args": safe_args, "dataset": state.get("dataset"),
        "servers": {k: v["server"] for k, v in runs.items() if v},
        "unavailable": problems, "log_dir": str(log_dir) if not args.base_url else None,
    }
    print_report(args, result, cache, base, started)
    if args.json is not None:
        path = Path(args.json or BENCH_DIR / "results" /
                    f"serve_bench-{started.strftime('%Y%m%d-%H%M%S')}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n")
        log(f"wrote {path}")
    if own_logs and not problems:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif problems and own_logs:
        log(f"logs kept in {log_dir}")
    return 1 if "cache" in problems else 0


def _jsonable(o: Any) -> Any:
    """Strict JSON: inf (an unlimited request rate) becomes "inf", NaN null, paths strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_jsonable(v) for v in o]
    if o is None or isinstance(o, bool | int | float | str):
        return o
    return str(o)


def print_report(args: argparse.Namespace, result: dict[str, Any],
                 cache: dict[str, Any] | None, base: dict[str, Any] | None,
                 started: dt.datetime) -> None:
    m = result["meta"]
    print(f"\n## serve_bench results ({started:%Y-%m-%d %H:%M:%S}, wall {m['wall_s']:.0f} s, "
          f"{'quick' if args.quick else 'full'}, {m['machine']['nproc']} cores, "
          f"endpoint {args.endpoint})")
    if "reuse" in result:
        print(f"\n### Reuse: TTFT of a cold prompt vs the same prompt again (median of "
              f"{max(1, args.reuse_repeats)}, output {args.reuse_output_len} tokens)\n")
        print(rep.reuse_table(result["reuse"]))
        g = result["reuse_goal"]
        print(f"\ngoal {g['name']}: {g['verdict']} (measured "
              f"{rep.fmt(g['measured'], '.3f')})")
    if cache and "load" in cache:
        ds = m.get("dataset") or {}
        shape = (f"trace {Path(ds.get('trace', '')).name} rows {ds.get('trace_start')}+"
                 f"{ds.get('num_prompts')}, scale 1/{ds.get('trace_scale')}, time x"
                 f"{ds.get('trace_time_scale')}" if ds.get("dataset") == "trace" else
                 f"synthetic {ds.get('num_prefixes')} prefixes x {ds.get('prefix_len')} + "
                 f"{ds.get('suffix_len')} unique, output {ds.get('output_len')}")
        rate = "trace times" if args.request_rate is None else args.request_rate
        print(f"\n### Load: {shape}; {args.num_prompts} requests, rate {rate}, max concurrency "
              f"{args.max_concurrency}\n")
        cols: dict[str, dict[str, Any] | None] = {"cache": cache["load"]}
        if base and "load" in base:
            cols["baseline (--no-prefix-cache)"] = base["load"]
        print(rep.load_table(cols, args.percentiles, args.pmetrics))
        errs = rep.errors_block(cols)
        if errs:
            print("\n" + errs)
    for label, why in m["unavailable"].items():
        print(f"\nUNAVAILABLE {label}: {why.splitlines()[0]}")
    print()


if __name__ == "__main__":
    sys.exit(main())
