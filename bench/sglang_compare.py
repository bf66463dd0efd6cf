"""SGLang three ways on one machine, one run: what our KV pool adds to SGLang (issue 9).

Targets (each started alone, so none competes with another for the cores):
  a. `sglang-2-rr`:      two plain SGLang servers (no PD, their own radix cache) behind
                         client-side round-robin;
  b. `sglang-2-hicache`: the same two servers with HiCache whose L3 is our pool (a master and
                         one store node started for it), still no PD;
  c. `ours`:             `mooncake up --engine sglang` (2 prefill, 1 decode, the Conductor):
                         PD through our transfer engine, prefill HiCache on our pool.
Every SGLang gets the flags our worker gives it on CPU (`engine.sglang.server`: CPU_FLAGS,
--max-total-tokens 16384, page size 64, --enable-metrics; HiCache host pool = device pool)
plus `--dtype` (float32 by default: SGLang's own choice for this float32 checkpoint is float16,
which prefills ~4x slower on a CPU without native fp16 math); a and b are built from the
worker's own `SglangServer` minus the PD flags (and for a, minus HiCache), plus
--enable-cache-report so their usage carries cached_tokens.

Workload, the same token ids for every target (the shape of `engine_compare.py`):
  1. shared prefixes: G groups, each a PREFIX-token prefix + a short unique suffix. Requests go
     in pairs (repeat of group g, cold of group g+1) sent together; under round-robin every
     repeat lands on the instance that did not compute its prefix, so a hit needs a pool.
     TTFT of colds and repeats, repeat hit rate (usage.cached_tokens / prompt), and for b and
     ours the pages loaded from our pool (cross-instance hits).
  2. unique prompts, one at a time: TTFT without any reuse (the pool's overhead vs a).
  3. a short burst of unique prompts, all at once: throughput (tokens/s).

Targets: repeat TTFT <= 0.3x cold at 2K tokens (ours); unique TTFT p50 of ours <= 1.10x a's.

    python bench/sglang_compare.py --json bench/results/sglang_compare-cpu.json
    python bench/sglang_compare.py --quick          # smoke run: smaller workload
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script: make the `bench` package importable. Appended, not prepended, so the repo
# root (it holds an `operator/` directory) cannot shadow the standard library.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.engine_compare import VOCAB_HI, VOCAB_LO, ttft_summary, workload
from bench.serve.client import ApiConfig, RequestOutput, RequestSpec, send
from bench.serve.load import new_session
from bench.serve.report import fmt, table
from mooncake_k8s.engine.child import EngineChild
from mooncake_k8s.engine.embedded import EngineConfig
from mooncake_k8s.engine.loading import model_source
from mooncake_k8s.engine.sglang.server import CPU_PATH, SglangServer, SglangServerConfig
from mooncake_k8s.store.testing import StoreCluster, metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
PAGE = 64
TARGETS = ("sglang-2-rr", "sglang-2-hicache", "ours")
#: Flags of our worker's SGLang command line that a plain (non-PD) server drops, with a value.
PD_FLAGS = {"--disaggregation-mode", "--disaggregation-transfer-backend",
            "--disaggregation-bootstrap-port"}
HICACHE_FLAGS = {"--hicache-storage-backend", "--hicache-storage-backend-extra-config",
                 "--hicache-ratio", "--hicache-size", "--hicache-io-backend",
                 "--hicache-mem-layout"}
HICACHE_BARE = {"--enable-hierarchical-cache"}
POOL_METRIC = "mooncake_sglang_hicache_pages_total"


def _strip(cmd: list[str], valued: set[str], bare: set[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in cmd:
        if skip:
            skip = False
        elif a in valued:
            skip = True
        elif a not in bare:
            out.append(a)
    return out


class PlainSglang(SglangServer):
    """Our worker's SGLang server without PD (and without HiCache unless `hicache`): the same
    command line, environment and CPU layer, so the peers differ from ours only in what is
    named. Its output goes to `log`."""

    def __init__(self, cfg: SglangServerConfig, hicache: bool, log: Path) -> None:
        super().__init__(cfg)  # role "prefill": the role that carries the HiCache flags
        self.hicache = hicache
        self.log = log

    def command(self) -> list[str]:
        cmd = _strip(super().command(), PD_FLAGS, set())
        if not self.hicache:
            cmd = _strip(cmd, HICACHE_FLAGS, HICACHE_BARE)
        # exec: the shell becomes SGLang, so the process group the base class stops is its own.
        return ["/bin/sh", "-c", 'exec "$@" >"$0" 2>&1', str(self.log), *cmd]

    def env(self) -> dict[str, str]:
        if self.hicache:  # our plug-in's CPU shims (HiCache host pool) and the pool's token
            return super().env()
        env = EngineChild.env(self)  # plain SGLang: only what SGLang needs on a CPU
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(CPU_PATH), env.get("PYTHONPATH", "")) if p)
        return env


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


@contextmanager
def plain_sglang(n: int, hicache: bool, log_dir: Path, engine_args: list[str]
                 ) -> Iterator[tuple[list[str], list[PlainSglang]]]:
    """`n` plain SGLang servers, started side by side; with `hicache`, on a fresh pool (master
    and one store node)."""
    path, fp, _ = model_source(EngineConfig(), progress=False)
    name = "hicache" if hicache else "plain"
    token = secrets.token_hex(16)
    with contextlib.ExitStack() as stack:
        master = ""
        if hicache:
            store = stack.enter_context(StoreCluster(token=token, workdir=log_dir / "store"))
            (log_dir / "store").mkdir(parents=True, exist_ok=True)
            store.start_master()
            store.start_node("n0", "2GiB")
            master = store.master_address
        servers = [PlainSglang(SglangServerConfig(
            model_dir=path, served_name=MODEL, fingerprint=fp.hex(), page_tokens=PAGE,
            master=master, token=token, role="prefill", device="cpu",
            extra_args=["--enable-cache-report", *engine_args], ready_timeout_s=900),
            hicache, log_dir / f"{name}-{i}.log") for i in range(n)]
        for s in servers:
            stack.callback(s.stop)
        with ThreadPoolExecutor(n) as pool:
            for s, fut in [(s, pool.submit(s.start)) for s in servers]:
                try:
                    fut.result()
                except RuntimeError as e:
                    raise RuntimeError(f"{e}\n{_tail(s.log)}") from e
        yield [f"http://127.0.0.1:{s.port}" for s in servers], servers


@contextmanager
def ours(log_dir: Path, engine_args: list[str]) -> Iterator[tuple[list[str], LocalCluster]]:
    cfg = UpConfig(port=0, prefill=2, decode=1, engine="sglang", device="cpu",
                   engine_args=engine_args,
                   store_size=2 << 30, log_dir=str(log_dir / "ours"), ready_timeout_s=900)
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        yield [c.base_url], c


def burst_workload(n: int, length: int, out_len: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed + 1_000_003)
    return [RequestSpec([int(x) for x in rng.integers(VOCAB_LO, VOCAB_HI, length)], length,
                        out_len, tag=f"burst-{i}") for i in range(n)]


async def _run(urls: list[str], pairs: list[list[RequestSpec]], uniq: list[RequestSpec],
               burst: list[RequestSpec]) -> tuple[dict[str, list[RequestOutput]], float]:
    """Runs the phases; returns every result by kind and the burst's wall time."""
    apis = [ApiConfig(u, MODEL) for u in urls]
    out: dict[str, list[RequestOutput]] = {"cold": [], "repeat": [], "unique": [], "burst": []}
    rr = 0

    def nxt() -> ApiConfig:
        nonlocal rr
        rr += 1
        return apis[(rr - 1) % len(apis)]

    async with new_session() as session:
        # Warm-up: two at once (one per instance under round-robin; a load-aware Conductor
        # spreads them too), 80 tokens each so the first page write is warm as well.
        warm = [RequestSpec([VOCAB_LO + i] * 80, 80, 2) for i in range(2)]
        for r in await asyncio.gather(*(send(session, nxt(), s) for s in warm)):
            if not r.success:
                raise RuntimeError(f"warm-up failed: {r.error}")
        rr = 0
        for pair in pairs:
            got = await asyncio.gather(*(send(session, nxt(), spec) for spec in pair))
            for spec, res in zip(pair, got, strict=True):
                out[spec.tag.split("-")[0]].append(res)
        for spec in uniq:
            out["unique"].append(await send(session, nxt(), spec))
        t0 = time.monotonic()
        out["burst"] = list(await asyncio.gather(*(send(session, nxt(), s) for s in burst)))
        burst_s = time.monotonic() - t0
    return out, burst_s


def summarise(name: str, res: dict[str, list[RequestOutput]], burst_s: float,
              pool: dict[str, float] | None) -> dict[str, Any]:
    burst = [r for r in res["burst"] if r.success]
    out_tok = sum(r.output_tokens for r in burst)
    all_tok = out_tok + sum(r.prompt_len for r in burst)
    loaded = pool["loaded"] if pool else None
    rep_tokens = sum(r.prompt_len for r in res["repeat"] if r.success)
    return {
        "target": name, **ttft_summary(res),
        "pool_pages_loaded": loaded,
        "pool_hit_rate": loaded * PAGE / rep_tokens if loaded is not None and rep_tokens else None,
        "pool_pages": pool,
        "burst_s": burst_s, "burst_tok_s": all_tok / burst_s if burst_s and burst else None,
        "burst_out_tok_s": out_tok / burst_s if burst_s and burst else None,
        "requests": {k: [r.to_json() for r in v] for k, v in res.items()},
    }


def _pool_pages(texts: list[str]) -> dict[str, float]:
    return {o: sum(metric_value(t, POOL_METRIC, f'outcome="{o}"') for t in texts)
            for o in ("loaded", "missed", "saved")}


def _run_target(name: str, a: argparse.Namespace, pairs: list[list[RequestSpec]],
                uniq: list[RequestSpec], burst: list[RequestSpec]) -> dict[str, Any]:
    log_dir = a.log_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    engine_args = [] if a.dtype == "auto" else ["--dtype", a.dtype]
    if name == "ours":
        with ours(log_dir, engine_args) as (urls, cluster):
            up_s = time.monotonic() - t_start

            def scrape() -> dict[str, float]:
                return _pool_pages([cluster.procs[f"prefill-{i}"].metrics() for i in range(2)])

            before = scrape()
            res, burst_s = asyncio.run(_run(urls, pairs, uniq, burst))
            after = scrape()
    else:
        hicache = name == "sglang-2-hicache"
        with plain_sglang(2, hicache, log_dir, engine_args) as (urls, servers):
            up_s = time.monotonic() - t_start

            def scrape() -> dict[str, float]:
                stats = [s.connector_stats() for s in servers]
                return {o: float(sum(st.get(f"pages_{o}", 0) for st in stats))
                        for o in ("loaded", "missed", "saved")}

            before = scrape()
            res, burst_s = asyncio.run(_run(urls, pairs, uniq, burst))
            after = scrape()
            if not hicache:
                after = before = {}
    pool = {k: after[k] - before[k] for k in after} or None
    row = summarise(name, res, burst_s, pool)
    row["startup_s"] = up_s
    return row


def _machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str] = {}
    for mod in ("sglang", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            versions[mod] = version(mod)
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": platform.node(),
            "cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "versions": versions, "git_commit": commit, "loadavg_at_start": os.getloadavg(),
            "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                   / 2**30, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 groups, 3 unique prompts of 512, a burst of 4")
    ap.add_argument("--groups", type=int, default=None, help="shared-prefix groups (4)")
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--unique", type=int, default=None, help="unique prompts (4)")
    ap.add_argument("--unique-len", type=int, default=None, help="their tokens (1024)")
    ap.add_argument("--burst", type=int, default=None, help="burst prompts, all at once (6)")
    ap.add_argument("--burst-len", type=int, default=512)
    ap.add_argument("--burst-output", type=int, default=32)
    ap.add_argument("--dtype", default="float32",
                    help="SGLang --dtype for every instance ('auto': SGLang's choice)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="write the rows here, and the printed table beside it (.txt)")
    ap.add_argument("--note", default="", help="a line for the .txt header (machine state)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/sglang-compare"))
    a = ap.parse_args()
    quick = {"groups": 2, "unique": 3, "unique_len": 512, "burst": 4}
    full = {"groups": 4, "unique": 4, "unique_len": 1024, "burst": 6}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    names = a.targets.split(",")
    if bad := [n for n in names if n not in TARGETS]:
        ap.error(f"unknown target(s) {bad}; choose from {TARGETS}")
    # SIGTERM unwinds like Ctrl-C, so every context manager stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = _machine()
    a.log_dir.mkdir(parents=True, exist_ok=True)
    pairs, uniq = workload(a.groups, a.prefix, a.suffix, a.unique, a.unique_len, a.seed)
    # Repeat first in each pair: under round-robin every repeat then lands on the instance
    # that did not compute its prefix (colds all on instance 0, repeats all on instance 1).
    pairs = [list(reversed(p)) for p in pairs]
    burst = burst_workload(a.burst, a.burst_len, a.burst_output, a.seed)
    rows = []
    t_all = time.monotonic()
    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        rows.append(_run_target(name, a, pairs, uniq, burst))
        print(f"   done in {time.monotonic() - t0:.0f} s (startup {rows[-1]['startup_s']:.0f} s)",
              flush=True)
    meta["wall_s"] = time.monotonic() - t_all
    headers = ["target", "cold TTFT p50", "p99", "repeat TTFT p50", "p99", "repeat/cold",
               "repeat hit rate", "pool pages loaded", "pool hit rate", "unique TTFT p50",
               "p99", "burst tok/s", "out tok/s", "failed"]
    cells = [[r["target"], fmt(r["cold_ttft_p50_ms"], ".0f"), fmt(r["cold_ttft_p99_ms"], ".0f"),
              fmt(r["repeat_ttft_p50_ms"], ".0f"), fmt(r["repeat_ttft_p99_ms"], ".0f"),
              fmt(r["repeat_over_cold"], ".3f"), fmt(r["repeat_hit_rate"], ".2f"),
              fmt(r["pool_pages_loaded"], "d"), fmt(r["pool_hit_rate"], ".2f"),
              fmt(r["unique_ttft_p50_ms"], ".0f"), fmt(r["unique_ttft_p99_ms"], ".0f"),
              fmt(r["burst_tok_s"], ".0f"), fmt(r["burst_out_tok_s"], ".1f"), str(r["failed"])]
             for r in rows]
    lines = [f"TTFT in ms; prefix {a.prefix} + suffix {a.suffix} tokens, {a.groups} groups "
             f"(every repeat on the other instance); {a.unique} unique prompts of "
             f"{a.unique_len} tokens; burst of {a.burst} x {a.burst_len} tokens, "
             f"{a.burst_output} out; page {PAGE}; --dtype {a.dtype}",
             table(headers, cells)]
    by = {r["target"]: r for r in rows}
    checks = []
    if "ours" in by:
        ratio = by["ours"]["repeat_over_cold"]
        checks.append((f"ours: repeat TTFT <= 0.3x cold at {a.prefix} tokens",
                       ratio is not None and ratio <= 0.3, fmt(ratio, ".3f")))
    if "ours" in by and "sglang-2-rr" in by:
        o, b = by["ours"]["unique_ttft_p50_ms"], by["sglang-2-rr"]["unique_ttft_p50_ms"]
        rel = o / b if o and b else None
        checks.append(("ours: unique TTFT p50 <= 1.10x sglang-2-rr",
                       rel is not None and rel <= 1.1, fmt(rel, ".3f")))
    lines += [f"{'MET ' if ok else 'MISS'} {what}: {val}" for what, ok, val in checks]
    text = "\n".join(lines)
    print("\n" + text)
    if a.json:
        meta["args"] = vars(a) | {"json": str(a.json), "log_dir": str(a.log_dir)}
        a.json.write_text(json.dumps({"meta": meta, "rows": rows,
                                      "checks": [list(c) for c in checks]}, indent=1))
        head = (f"machine: {meta['cpus']}-core {meta['cpu_model'] or 'CPU'}, {meta['date']}, "
                f"sglang {meta['versions'].get('sglang', '?')}, {MODEL}"
                + (f"; {a.note}" if a.note else ""))
        a.json.with_suffix(".txt").write_text(f"{head}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
