#!/usr/bin/env python3
"""KV across hosts (issue 20's table): placement, layer-wise streaming and the network-aware
cost model, measured on the multi-host test bed with the real model.

Each configuration runs a fresh `BedCluster` (master, store node, 2 prefill and 2 decode hosts,
the Conductor; every host its own address, IPC namespace and a tbf-shaped link; one engine
thread per worker) and measures, with prompts of about 3K tokens (each cold prompt starts with
its own words, so no two share a block):

- repeat bytes: the bytes all hosts received over their links while a prompt is repeated
  (routed by the Conductor, which sends it to the instances holding its prefix), over the
  prompt's KV bytes;
- repeat TTFT / cold TTFT at 1 Gbit/s and 100 Mbit/s (streamed; TTFT = first content chunk);
- cold TTFT at 100 Mbit/s over cold TTFT on unlimited links (does transfer overlap compute?);
- ours only: a prefix computed on host A (prefill-0) and requested on host B (prefill-1), at
  1 Gbit/s: bytes into B over the prefix's KV (moved once?) and the rate of its load phase
  (B's `mooncake_prefill_seconds{phase="load"}`) against the link;
- ours only: fetch or recompute, at 100 Mbit/s and 10 Gbit/s for 1K and 3K-token prefixes held
  on A and requested on B: both measured (Conductors that only know B: one that never fetches,
  one whose cost model makes fetching free), and the choice the scheduler makes with the link
  `mooncake calibrate --links-only` measured at that rate.

The baseline, in the same run, is the product before this issue: prefill hosts serve no pool
memory (`--local-segment-size 0`: new blocks go to decode's host and one more node) and KV is
stored after the prefill (`MOONCAKE_KV_LAYERWISE=0`).

Usage: python bench/multihost_bench.py [--tokens 3000] [--skip-choice] (about 12 min)
Needs root and network namespaces (docs/testbed.md). Writes bench/results/multihost_bench.json
and .txt.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig, http_ok

MiB = 1 << 20
BENCH_DIR = Path(__file__).resolve().parent
MODEL = "SmolLM2-135M-Instruct"
KV_BYTES_PER_TOKEN = 46080
"""SmolLM2-135M in float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes."""
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie", "quartz", "reef",
         "savanna", "tundra", "upland", "valley", "willow", "yarrow", "zephyr"]
SEGMENT = 768 * MiB
SIDE_PORT = 100
"""Side Conductors listen at the main one's port + this + i (on the Conductor's host)."""


def prompt(tag: str, tokens: int) -> str:
    """About `tokens` tokens of chat, starting with words of its own (`tag`): two prompts of
    different tags share no KV block."""
    n = max(8, int(tokens * 0.98) - 40)
    body = " ".join(WORDS[(i * 7 + i // 5 + len(tag)) % len(WORDS)] for i in range(n))
    return f"{tag} {tag} {tag}. Repeat the last word: {body}"


# -- clients (run on the Conductor's host through `client_call`) -----------------------------


def stream_chat(url: str, text: str, max_tokens: int = 8) -> dict[str, Any]:
    """One streamed chat completion: TTFT (first content chunk), text, route headers."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, out, usage = None, [], {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.monotonic() - t0
                out.append(piece)
    conn.close()
    return {"ttft_s": ttft, "text": "".join(out), "usage": usage,
            "prefill": resp.getheader("X-Mooncake-Prefill", ""),
            "decode": resp.getheader("X-Mooncake-Decode", ""),
            "cached_tokens": int(resp.getheader("X-Mooncake-Cached-Tokens", "0") or 0)}


def metric_sum(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample family's values whose label text contains `labels`."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return metric_value(r.read().decode(), name, labels)


# -- the cluster ----------------------------------------------------------------------------


class Bench:
    def __init__(self, cluster: BedCluster, echo: Callable[[str], None]) -> None:
        self.c = cluster
        self.echo = echo
        self.sides: dict[str, str] = {}

    def received(self) -> dict[str, int]:
        return {h: rx for h, (_tx, rx) in self.c.bed.counters().items()}

    def shape(self, rate: str | None) -> None:
        for h in self.c.hosts.values():
            h.shape(rate=rate)

    def chat(self, text: str, via: str = "") -> dict[str, Any]:
        url = self.sides[via] if via else self.c.base_url
        before = self.received()
        r = self.c.client_call(stream_chat, url, text)
        after = self.received()
        r["received"] = {h: after[h] - before[h] for h in after}
        r["net_bytes"] = sum(r["received"].values())
        r["kv_bytes"] = r["usage"].get("prompt_tokens", 0) * KV_BYTES_PER_TOKEN
        self.echo(f"    {via or 'main':9} ttft {r['ttft_s']:.2f}s prompt "
                  f"{r['usage'].get('prompt_tokens')} cached {r['cached_tokens']} "
                  f"net {r['net_bytes'] / MiB:.1f} MiB via {r['prefill']}")
        return r

    def start_side(self, name: str, prefills: list[str], extra: list[str]) -> None:
        """Another Conductor on the Conductor's host that knows only `prefills` (and every
        decode): it forces where a prompt is computed, and how."""
        c = self.c
        port = c.service_port + SIDE_PORT + len(self.sides)
        host = c.hosts["conductor"]
        addrs = ",".join(f"{c.hosts[n].addr}:{c.service_port}" for n in prefills)
        decodes = ",".join(f"{c.hosts[n].addr}:{c.service_port}" for n in c.workers
                           if n.startswith("decode"))
        args = ["conductor", "--host", host.addr, "--port", str(port), "--master", c.master,
                "--prefill", addrs, "--decode", decodes, "--metrics-port", str(port + 50),
                "--metrics-on-api-port", "--block-tokens", "64", *extra]
        c.procs[name] = host.spawn([sys.executable, "-m", "mooncake_k8s.cli", *args],
                                   env=c.env(), log=c.log_dir / f"{name}.log")
        self.sides[name] = f"http://{host.addr}:{port}"

    def wait_sides(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for name, url in self.sides.items():
            while not self.c.client_call(http_ok, f"{url}/readyz"):
                self.c.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready; see {self.c.log(name)}")
                time.sleep(0.3)

    def store_used(self) -> float:
        """Bytes the master counts allocated over every segment."""
        m = self.c.hosts["master"]
        return m.call(metric_sum, f"http://{m.addr}:{self.c.metrics_port}/metrics",
                      "mooncake_store_used_bytes")

    def load_seconds(self, worker: str) -> float:
        url = f"http://{self.c.hosts[worker].addr}:{self.c.metrics_port}/metrics"
        return self.c.hosts[worker].call(metric_sum, url, "mooncake_prefill_seconds_sum",
                                         'phase="load"')


# -- the measurements -----------------------------------------------------------------------


def repeat_rows(b: Bench, tokens: int, label: str) -> dict[str, Any]:
    """Cold and repeat at 1 Gbit/s and 100 Mbit/s; cold on unlimited links."""
    out: dict[str, Any] = {}
    for rate in ("1gbit", "100mbit", None):
        b.shape(rate)
        name = rate or "unlimited"
        b.echo(f"  [{label}] {name}")
        text = prompt(f"{label}{name}", tokens)
        used = b.store_used()
        cold = b.chat(text)
        row: dict[str, Any] = {"cold": cold, "copies": (b.store_used() - used) / cold["kv_bytes"]}
        if rate is not None:
            row["repeat"] = b.chat(text)
        out[name] = row
    b.shape("1gbit")
    return out


def a_to_b_row(b: Bench, tokens: int) -> dict[str, Any]:
    """A prefix computed on prefill-0, then requested (plus a new tail) on prefill-1, after
    one such fetch of another prefix (a server's steady state: B's staging memory in use)."""
    b.shape("1gbit")
    warm = prompt("atobwarm", tokens)  # B's first fetch of this size faults in its staging
    b.chat(warm, via="on-a")
    b.chat(warm + " And once more: meadow.", via="fetch-b")
    text = prompt("atob", tokens)
    b.chat(text, via="on-a")
    load0 = b.load_seconds("prefill-1")
    r = b.chat(text + " And once more: meadow.", via="fetch-b")
    load_s = b.load_seconds("prefill-1") - load0
    prefix_bytes = r["cached_tokens"] * KV_BYTES_PER_TOKEN
    return {"request": r, "into_b": r["received"]["prefill-1"], "prefix_bytes": prefix_bytes,
            "load_s": load_s,
            "rate_Bps": prefix_bytes / load_s if load_s > 0 else 0.0}


CHOICES = [("50mbit", [1000]), ("100mbit", [1000, 0]), ("10gbit", [1000, 0])]
"""Rates and prefix lengths of the fetch-or-recompute rows (0 = the long prompts' length);
50 Mbit/s beside the issue's two rates: on this CPU a prefix moves at 100 Mbit/s a little
faster than it computes, so only a slower link shows the recompute side."""


def choice_rows(b: Bench, tokens: int, base: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = []
    for rate, sizes in CHOICES:
        b.shape(rate)
        prof = calibrate_links(b, base)
        for size in sizes:
            n = size or tokens
            b.echo(f"  [choice] {rate} {n} tokens")
            t1, t2 = prompt(f"rc{rate}{n}", n), prompt(f"fe{rate}{n}", n)
            b.chat(t1, via="on-a")
            b.chat(t2, via="on-a")
            tail = " Then say: valley."
            recompute = b.chat(t1 + tail, via="recompute-b")
            fetch = b.chat(t2 + tail, via="fetch-b")
            faster = "fetch" if fetch["ttft_s"] < recompute["ttft_s"] else "recompute"
            chosen = (choose(prof, fetch["cached_tokens"], fetch["usage"]["prompt_tokens"])
                      if prof is not None else "no calibration")
            rows.append({"rate": rate, "tokens": n, "profile": prof,
                         "recompute_ttft_s": recompute["ttft_s"], "fetch_ttft_s": fetch["ttft_s"],
                         "fetched_tokens": fetch["cached_tokens"], "faster": faster,
                         "chosen": chosen, "correct": chosen == faster})
    b.shape("1gbit")
    return rows


def choose(prof: dict[str, Any] | None, cached: int, prompt_tokens: int) -> str:
    """What the Conductor's scheduler decides for instance B (nothing local, `cached` tokens
    held on another host) with the calibrated profile: its own code, in process."""
    from mooncake_k8s.conductor.sched import costmodel
    from mooncake_k8s.conductor.sched.kvindex import STORED, KVIndex
    from mooncake_k8s.conductor.sched.scheduler import (
        DecodeView,
        Demand,
        PrefillView,
        Scheduler,
        SchedulerConfig,
    )

    d = prof or costmodel.load(costmodel.BUILTIN_CPU_PROFILE).to_dict()
    model = costmodel.CostModel.from_dict({k: v for k, v in d.items() if k != "file"})
    index = KVIndex()
    keys = [f"k{i}" for i in range(prompt_tokens // 64)]
    for k in keys[: cached // 64]:
        index.apply(STORED, k, "host-a-segment")
    sched = Scheduler(SchedulerConfig(policy="global_cache_aware"), model, index)
    dec = sched.decide(Demand(keys, prompt_tokens, 8, block_tokens=64),
                       [PrefillView(0, 0.0)], [DecodeView(0)], 0.0)
    return "fetch" if dec.fetch_blocks else "recompute"


def calibrate(b: Bench, args: list[str], name: str) -> dict[str, Any] | None:
    """`mooncake calibrate ARGS --out F` run on the Conductor's host; the profile written (None
    when it fails: the choice is then judged with the shipped profile, and said)."""
    c = b.c
    out = c.log_dir / f"{name}-{time.monotonic_ns()}.json"
    log = c.log_dir / f"{name}.log"
    p = c.hosts["conductor"].spawn([sys.executable, "-m", "mooncake_k8s.cli", "calibrate",
                                    *args, "--out", str(out)], env=c.env(), log=log)
    try:
        p.wait(timeout=900)
    except Exception:
        p.kill()
        return None
    if p.returncode != 0 or not out.exists():
        b.echo(f"    calibrate failed ({p.returncode}); see {log}")
        return None
    prof: dict[str, Any] = json.loads(out.read_text())
    pool, pf = prof["transfer"]["pool"], prof["prefill"]
    b.echo(f"    {name}: pool {pool['latency_ms']:.2f} ms + {pool['gbps']:.4f} GB/s; prefill "
           f"{pf['base_ms']:.0f} ms + {pf['per_token_ms']:.2f} ms/token + "
           f"{pf['attn_ms']:.5f} ms/token^2")
    prof["file"] = str(out)
    return prof


def calibrate_prefill(b: Bench) -> dict[str, Any] | None:
    """The deployment's prefill and decode, measured as `mooncake calibrate` does, through a
    Conductor that knows only host B (no links: each rate measures its own)."""
    b.shape(None)
    return calibrate(b, ["--url", b.sides["recompute-b"], "--master", b.c.master,
                         "--no-links", "--lengths", "256,1024,2048,4096", "--repeats", "1",
                         "--batches", "1,2", "--decode-tokens", "8"], "calibrate-prefill")


def calibrate_links(b: Bench, base: dict[str, Any] | None) -> dict[str, Any] | None:
    """`mooncake calibrate --links-only` into the calibrated profile, at the current rate."""
    args = ["--links-only", "--master", b.c.master, "--link-sizes", "256KiB,2MiB,8MiB",
            "--link-repeats", "2"]
    if base is not None:
        args += ["--profile", base["file"]]
    return calibrate(b, args, "calibrate-links")


def run_config(label: str, tokens: int, ours: bool, args: argparse.Namespace,
               echo: Callable[[str], None]) -> dict[str, Any]:
    env = {} if ours else {"MOONCAKE_KV_LAYERWISE": "0"}
    cfg = BedConfig(prefill=2, decode=2, rate="1gbit", store_size=512 * MiB,
                    decode_segment_size=SEGMENT, prefill_segment_size=SEGMENT if ours else 0,
                    extra_env=env, ready_timeout_s=400,
                    log_dir=tempfile.mkdtemp(prefix=f"mh-bench-{label}-"))
    echo(f"[{label}] starting the cluster (logs: {cfg.log_dir})")
    with Testbed() as bed, BedCluster(bed, cfg, echo=lambda _m: None) as c:
        b = Bench(c, echo)
        if ours:
            b.start_side("on-a", ["prefill-0"], ["--scheduler", "local_cache_aware"])
            b.start_side("recompute-b", ["prefill-1"], ["--scheduler", "local_cache_aware"])
            free = Path(cfg.log_dir) / "free-fetch.json"  # type: ignore[arg-type]
            free.write_text(json.dumps(_free_fetch_model()))
            b.start_side("fetch-b", ["prefill-1"], ["--cost-model", str(free)])
            b.wait_sides()
        b.chat(prompt("warmup", 200))
        out: dict[str, Any] = {"repeat": repeat_rows(b, tokens, label)}
        if ours:
            out["a_to_b"] = a_to_b_row(b, tokens)
            if not args.skip_choice:
                out["choice"] = choice_rows(b, tokens, calibrate_prefill(b))
        out["store_used_bytes"] = b.store_used()
        return out


def _free_fetch_model() -> dict[str, Any]:
    """The CPU profile with a pool link so fast that fetching always wins (forces a fetch)."""
    from mooncake_k8s.conductor.sched import costmodel

    d = costmodel.load(costmodel.BUILTIN_CPU_PROFILE).to_dict()
    d["name"] = "free-fetch"
    d["transfer"]["pool"] = {"latency_ms": 0.0, "gbps": 1000.0}
    return d


# -- the table ------------------------------------------------------------------------------


def table(res: dict[str, Any]) -> list[list[str]]:
    rows = [["measure", "target", "ours", "baseline", "met"]]

    def both(fn: Callable[[dict[str, Any]], float]) -> tuple[float, float]:
        return fn(res["ours"]["repeat"]), fn(res["baseline"]["repeat"])

    o, b = both(lambda r: r["1gbit"]["repeat"]["net_bytes"] / r["1gbit"]["repeat"]["kv_bytes"])
    rows.append(["repeat: bytes over the network / prompt KV (1 Gbit/s)", "<= 10%",
                 f"{o:.1%}", f"{b:.1%}", _met(o <= 0.10)])
    def ratio(k: str) -> Callable[[dict[str, Any]], float]:
        return lambda r: float(r[k]["repeat"]["ttft_s"] / r[k]["cold"]["ttft_s"])

    for rate in ("1gbit", "100mbit"):
        o, b = both(ratio(rate))
        rows.append([f"repeat TTFT / cold TTFT at {rate}", "<= 0.05", f"{o:.3f}", f"{b:.3f}",
                     _met(o <= 0.05)])
    o, b = both(lambda r: r["100mbit"]["cold"]["ttft_s"] / r["unlimited"]["cold"]["ttft_s"])
    rows.append(["cold TTFT 100 Mbit/s / unlimited", "<= 1.25", f"{o:.2f}", f"{b:.2f}",
                 _met(o <= 1.25)])
    o, b = both(lambda r: r["1gbit"]["copies"])
    rows.append(["copies of a prompt's KV after one cold request (segment bytes / KV)",
                 "report", f"{o:.2f}", f"{b:.2f}", "-"])
    ab = res["ours"].get("a_to_b")
    if ab:
        moved = ab["into_b"] / ab["prefix_bytes"] if ab["prefix_bytes"] else 0.0
        share = ab["rate_Bps"] / (1e9 / 8)
        rows.append(["A->B prefix at 1 Gbit/s: bytes into B / prefix KV", "~1.0 (once)",
                     f"{moved:.2f}", "-", _met(0.9 <= moved <= 1.2)])
        rows.append(["A->B prefix load rate / link rate", ">= 85%", f"{share:.0%}", "-",
                     _met(share >= 0.85)])
    for ch in res["ours"].get("choice", []):
        rows.append([f"fetch or recompute, {ch['rate']}, {ch['tokens']} tokens "
                     f"(fetch {ch['fetch_ttft_s']:.2f}s, recompute {ch['recompute_ttft_s']:.2f}s)",
                     "the faster", f"{ch['chosen']}", "-", _met(ch["correct"])])
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def render(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000, help="long prompts' length")
    ap.add_argument("--skip-choice", action="store_true", help="skip fetch-or-recompute rows")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "multihost_bench"))
    args = ap.parse_args()
    res: dict[str, Any] = {
        "bench": "multihost_bench", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                   f"kernel {platform.release()}", "tokens": args.tokens}
    res["ours"] = run_config("ours", args.tokens, True, args, print)
    res["baseline"] = run_config("baseline", args.tokens, False, args, print)
    text = render(table(res))
    print(text)
    Path(args.out + ".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    Path(args.out + ".txt").write_text(f"{res['machine']}, {res['date']}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
