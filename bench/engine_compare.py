"""vLLM three ways on one machine, one run: what our KV pool adds to a real engine.

Targets (each started alone, so none competes with another for the cores):
  a. `vllm-1`:    one plain vLLM server with its own prefix cache;
  b. `vllm-2-rr`: two plain vLLM servers behind client-side round-robin;
  c. `ours`:      `mooncake up --engine vllm` (2 prefill, 1 decode, the Conductor), so every
                  vLLM's KV connector reads and writes our store.
Every vLLM gets the same flags (`up.VLLM_CPU_DEFAULTS` plus --max-model-len).

Workload, the same token ids for every target:
  1. shared prefixes: G groups, each a PREFIX-token prefix + a short unique suffix. Requests go
     in pairs (cold of group g+1, repeat of group g) sent together, so with two instances the
     repeat usually lands where the cold did not: a hit there needs a pool. TTFT of colds and
     repeats, repeat hit rate (usage.cached_tokens), and for ours the blocks its prefill
     instances loaded from the pool (cross-instance hits).
  2. unique prompts, one at a time: TTFT without any reuse (our overhead vs b).

Targets: repeat TTFT <= 0.3x cold at 2K tokens (ours); unique TTFT p50 of ours <= 1.10x b's.

    python bench/engine_compare.py --json bench/results/engine_compare-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script: make the `bench` package importable. Appended, not prepended, so the repo
# root (it holds an `operator/` directory) cannot shadow the standard library.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.serve.client import ApiConfig, RequestOutput, RequestSpec, send
from bench.serve.load import new_session
from bench.serve.report import fmt, table
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.engine.loading import ensure_builtin
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import VLLM_CPU_DEFAULTS, LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 64
VOCAB_LO, VOCAB_HI = 1000, 40000  # plain word-piece ids: no specials, no control tokens


def vllm_args(max_len: int) -> list[str]:
    args = list(VLLM_CPU_DEFAULTS)
    i = args.index("--max-model-len")
    args[i + 1] = str(max_len)
    return args


def workload(groups: int, prefix: int, suffix: int, unique: int, unique_len: int,
             seed: int) -> tuple[list[list[RequestSpec]], list[RequestSpec]]:
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(VOCAB_LO, VOCAB_HI, n)]

    heads = [ids(prefix) for _ in range(groups + 1)]
    cold = [RequestSpec(h + ids(suffix), prefix + suffix, 16, tag=f"cold-{g}")
            for g, h in enumerate(heads)]
    rep = [RequestSpec(h + ids(suffix), prefix + suffix, 16, tag=f"repeat-{g}")
           for g, h in enumerate(heads)]
    pairs = [[cold[0]]] + [[cold[g + 1], rep[g]] for g in range(groups)]
    uniq = [RequestSpec(ids(unique_len), unique_len, 16, tag=f"unique-{i}")
            for i in range(unique)]
    return pairs, uniq


def _wait(url: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a vLLM server exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


SITECUSTOMIZE = """import os
if os.environ.get("MOONCAKE_VLLM_IDLE_SPIN_S"):
    from mooncake_k8s.engine.vllm.spin import limit_idle_spin
    limit_idle_spin()
"""


@contextmanager
def plain_vllm(n: int, max_len: int, log_dir: Path, spin_cap: bool) -> Iterator[list[str]]:
    """Plain vLLM servers. With `spin_cap` they get the same idle-spin cap as our workers'
    vLLM (through a sitecustomize), so co-located servers compete on equal terms."""
    path, _ = ensure_builtin(progress=False)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if spin_cap:
        site = log_dir / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        env["MOONCAKE_VLLM_IDLE_SPIN_S"] = "0.05"
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for i in range(n):
            port = free_port()
            log = open(log_dir / f"plain-{n}-{i}.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                 str(path), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port",
                 str(port), "--block-size", str(BLOCK), "--enable-prompt-tokens-details",
                 *vllm_args(max_len)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            _wait(f"{u}/health", 900, procs)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@contextmanager
def ours(max_len: int, log_dir: Path) -> Iterator[tuple[list[str], LocalCluster]]:
    cfg = UpConfig(port=0, prefill=2, decode=1, engine="vllm", engine_args=vllm_args(max_len),
                   store_size=2 << 30, log_dir=str(log_dir / "ours"), ready_timeout_s=900)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield [c.base_url], c


async def _run(urls: list[str], pairs: list[list[RequestSpec]], uniq: list[RequestSpec]
               ) -> dict[str, list[RequestOutput]]:
    apis = [ApiConfig(u, MODEL) for u in urls]
    out: dict[str, list[RequestOutput]] = {"cold": [], "repeat": [], "unique": []}
    rr = 0
    async with new_session() as session:
        await send(session, apis[0], RequestSpec([VOCAB_LO] * 8, 8, 2))  # warm-up
        for pair in pairs:
            sends = []
            for spec in pair:
                sends.append(send(session, apis[rr % len(apis)], spec))
                rr += 1
            for spec, res in zip(pair, await asyncio.gather(*sends), strict=True):
                out[spec.tag.split("-")[0]].append(res)
        for spec in uniq:
            out["unique"].append(await send(session, apis[rr % len(apis)], spec))
            rr += 1
    return out


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, p))


def ttft_summary(res: dict[str, list[RequestOutput]]) -> dict[str, Any]:
    """What every engine comparison reports of the shared-prefix and unique phases: failures,
    TTFT percentiles (ms) of colds, repeats and unique prompts, repeat/cold, repeat hit rate."""
    def ttfts(kind: str) -> list[float]:
        return [r.ttft * 1e3 for r in res[kind] if r.success]

    reps = [r for r in res["repeat"] if r.success]
    cold, rep, uniq = ttfts("cold"), ttfts("repeat"), ttfts("unique")
    return {
        "failed": sum(not r.success for rs in res.values() for r in rs),
        "cold_ttft_p50_ms": _pct(cold, 50), "cold_ttft_p99_ms": _pct(cold, 99),
        "repeat_ttft_p50_ms": _pct(rep, 50), "repeat_ttft_p99_ms": _pct(rep, 99),
        "repeat_over_cold": (_pct(rep, 50) or 0) / (_pct(cold, 50) or 1) if cold else None,
        "repeat_hit_rate": (statistics.mean((r.cached_tokens or 0) / r.prompt_len for r in reps)
                            if reps else None),
        "unique_ttft_p50_ms": _pct(uniq, 50), "unique_ttft_p99_ms": _pct(uniq, 99),
    }


def summarise(name: str, res: dict[str, list[RequestOutput]], seconds: float,
              pool_loaded: float | None) -> dict[str, Any]:
    tokens = sum(r.output_tokens for rs in res.values() for r in rs if r.success)
    return {
        "target": name, **ttft_summary(res), "pool_loaded_blocks": pool_loaded,
        "output_tok_s": tokens / seconds if seconds else None,
        "requests": {k: [r.to_json() for r in v] for k, v in res.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--unique", type=int, default=6)
    ap.add_argument("--unique-len", type=int, default=1024)
    ap.add_argument("--targets", default="vllm-1,vllm-2-rr,ours")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/engine-compare"))
    ap.add_argument("--no-plain-spin-cap", action="store_true",
                    help="run plain vLLM with its own 1 s idle spin (ours always caps it)")
    a = ap.parse_args()
    max_len = max(a.prefix + a.suffix, a.unique_len) + 64
    a.log_dir.mkdir(parents=True, exist_ok=True)
    pairs, uniq = workload(a.groups, a.prefix, a.suffix, a.unique, a.unique_len, a.seed)
    rows = []
    for name in a.targets.split(","):
        print(f"== {name}", flush=True)
        pool: float | None = None
        if name == "ours":
            with ours(max_len, a.log_dir) as (urls, cluster):
                t0 = time.monotonic()
                res = asyncio.run(_run(urls, pairs, uniq))
                secs = time.monotonic() - t0
                pool = sum(metric_value(cluster.procs[f"prefill-{i}"].metrics(),
                                        "mooncake_vllm_kv_blocks_total", 'outcome="loaded"')
                           for i in range(2))
        else:
            n = 1 if name == "vllm-1" else 2
            with plain_vllm(n, max_len, a.log_dir, not a.no_plain_spin_cap) as urls:
                t0 = time.monotonic()
                res = asyncio.run(_run(urls, pairs, uniq))
                secs = time.monotonic() - t0
        rows.append(summarise(name, res, secs, pool))
    headers = ["target", "cold TTFT p50", "repeat TTFT p50", "p99", "repeat/cold",
               "repeat hit rate", "pool blocks loaded", "unique TTFT p50", "p99", "out tok/s",
               "failed"]
    cells = [[r["target"], fmt(r["cold_ttft_p50_ms"], ".0f"), fmt(r["repeat_ttft_p50_ms"], ".0f"),
              fmt(r["repeat_ttft_p99_ms"], ".0f"), fmt(r["repeat_over_cold"], ".3f"),
              fmt(r["repeat_hit_rate"], ".2f"), fmt(r["pool_loaded_blocks"], "d"),
              fmt(r["unique_ttft_p50_ms"], ".0f"), fmt(r["unique_ttft_p99_ms"], ".0f"),
              fmt(r["output_tok_s"], ".1f"), str(r["failed"])] for r in rows]
    print(f"\nTTFT in ms; prefix {a.prefix} + suffix {a.suffix} tokens, {a.groups} groups; "
          f"{a.unique} unique prompts of {a.unique_len} tokens; block {BLOCK}")
    print(table(headers, cells))
    by = {r["target"]: r for r in rows}
    checks = []
    if "ours" in by:
        ratio = by["ours"]["repeat_over_cold"]
        checks.append(("ours: repeat TTFT <= 0.3x cold", ratio is not None and ratio <= 0.3,
                       fmt(ratio, ".3f")))
    if "ours" in by and "vllm-2-rr" in by:
        o, b = by["ours"]["unique_ttft_p50_ms"], by["vllm-2-rr"]["unique_ttft_p50_ms"]
        rel = o / b if o and b else None
        checks.append(("ours: unique TTFT p50 <= 1.10x vllm-2-rr", rel is not None and rel <= 1.1,
                       fmt(rel, ".3f")))
    for what, ok, val in checks:
        print(f"{'MET ' if ok else 'MISS'} {what}: {val}")
    if a.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
                "cpus": os.cpu_count(), "args": vars(a) | {"json": str(a.json),
                                                          "log_dir": str(a.log_dir)}}
        a.json.write_text(json.dumps({"meta": meta, "rows": rows,
                                      "checks": [list(c) for c in checks]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
