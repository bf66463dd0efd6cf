#!/usr/bin/env python3
"""Decode failover: what keeping a pool copy costs, and how long a resume takes.

Two parts, each on a real `mooncake up` cluster (LocalCluster: 1 prefill, 2 decode, the
built-in model):

  pool copy    TTFT of cold prompts (nothing cached, so prefill writes every block) with
               prefill writing 1 replica (today's: only the decode's own segment) and 2 (the
               second on another node, which is what lets a stream survive its decode).
               Streaming, max_tokens=2, one request at a time; p50 and mean per setting.
  resume       with 2 replicas: N streams at temperature 0, kill -9 the decode serving the
               first one after a few tokens, and measure for each stream that was on it the
               client-visible stall (kill until the next token arrives) and the Conductor's
               `mooncake_conductor_resume_seconds` (failure detected until the new instance's
               first token). The killed decode is respawned between rounds.

Usage:
  python bench/failover_bench.py                       # writes bench/results/failover.json
  python bench/failover_bench.py --prompts 10 --rounds 2 --json /tmp/f.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]


def prompt(seed: int, n_words: int) -> str:
    return f"Note {seed}: " + " ".join(WORDS[(i * 5 + seed * 7 + i // 3) % len(WORDS)]
                                       for i in range(n_words))


def cluster(replicas: int, log_dir: str) -> LocalCluster:
    return LocalCluster(UpConfig(port=0, prefill=1, decode=2, store_size=512 << 20,
                                 store_replicas=replicas, log_dir=log_dir, threads=1,
                                 ready_timeout_s=600), echo=lambda _m: None)


def client(c: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0,
                         timeout=600)


def ttft_once(c: LocalCluster, text: str) -> float:
    t0 = time.perf_counter()
    stream = client(c).completions.create(model=MODEL, prompt=text, max_tokens=2,
                                          temperature=0, stream=True)
    first = None
    for ch in stream:
        if first is None and ch.choices:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def pool_copy(replicas: int, n: int, n_words: int, base: str) -> dict[str, Any]:
    with cluster(replicas, f"{base}/r{replicas}") as c:
        for i in range(3):  # warm-up (connections, first-call paths)
            ttft_once(c, prompt(10_000 + i, n_words))
        # Unique seeds per setting: every prompt is cold in both.
        ttfts = [ttft_once(c, prompt(replicas * 1000 + i, n_words)) for i in range(n)]
    return {"replicas": replicas, "n": n, "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1e3, "ttft_ms": [t * 1e3 for t in ttfts]}


def resume_round(c: LocalCluster, streams: int, max_tokens: int, seed0: int
                 ) -> tuple[list[float], str]:
    arrivals: dict[int, list[float]] = {i: [] for i in range(streams)}
    decodes: dict[int, str | None] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            raw = client(c).completions.with_raw_response.create(
                model=MODEL, prompt=prompt(seed0 + i, 120), max_tokens=max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            decodes[i] = raw.headers.get("x-mooncake-decode")
            for ch in raw.parse():
                if ch.choices:
                    arrivals[i].append(time.perf_counter())
        except openai.APIError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    while not all(len(a) >= 4 for a in arrivals.values()):
        if errors:
            raise RuntimeError(errors)
        time.sleep(0.01)
    victim = decodes[0]
    assert victim is not None
    killed_at = time.perf_counter()
    c.kill(victim)
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise RuntimeError(errors)
    stalls = []
    for i, d in decodes.items():
        a = arrivals[i]
        assert len(a) == max_tokens, (i, len(a))
        if d == victim:
            stalls.append(next(t for t in a if t > killed_at) - killed_at)
    return stalls, victim


def resume(rounds: int, streams: int, max_tokens: int, base: str) -> dict[str, Any]:
    stalls: list[float] = []
    with cluster(2, f"{base}/resume") as c:
        for r in range(rounds):
            s, victim = resume_round(c, streams, max_tokens, 100 * r)
            stalls += s
            if r + 1 < rounds:
                c.respawn(victim)
                c.wait_ready()
                while metric_value(c.procs["conductor"].metrics(), "mooncake_conductor_instances",
                                   'role="decode",state="ready"') < 2:
                    time.sleep(0.2)
        text = c.procs["conductor"].metrics()
    count = metric_value(text, "mooncake_conductor_resume_seconds_count")
    total = metric_value(text, "mooncake_conductor_resume_seconds_sum")
    return {"rounds": rounds, "streams": streams, "max_tokens": max_tokens,
            "resumed_streams": len(stalls),
            "resumes_ok": metric_value(text, "mooncake_conductor_resumes_total", 'outcome="ok"'),
            "resumes_failed": metric_value(text, "mooncake_conductor_resumes_total",
                                           'outcome="failed"'),
            "stall_p50_ms": statistics.median(stalls) * 1e3, "stall_max_ms": max(stalls) * 1e3,
            "stall_ms": [s * 1e3 for s in stalls],
            "conductor_resume_mean_ms": total / count * 1e3 if count else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20, help="cold prompts per setting")
    ap.add_argument("--words", type=int, default=400, help="words per cold prompt")
    ap.add_argument("--rounds", type=int, default=3, help="kill rounds")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "failover.json"))
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="failover-bench-")
    copies = [pool_copy(r, a.prompts, a.words, base) for r in (1, 2)]
    res = resume(a.rounds, a.streams, a.max_tokens, base)
    print(f"{'replicas':>8} {'TTFT p50 ms':>12} {'TTFT mean ms':>13}")
    for row in copies:
        print(f"{row['replicas']:>8} {row['ttft_p50_ms']:>12.1f} {row['ttft_mean_ms']:>13.1f}")
    print(f"resume: {res['resumed_streams']} streams resumed; client stall p50 "
          f"{res['stall_p50_ms']:.0f} ms, max {res['stall_max_ms']:.0f} ms; Conductor "
          f"resume_seconds mean {res['conductor_resume_mean_ms'] or 0:.0f} ms; "
          f"ok={res['resumes_ok']:.0f} failed={res['resumes_failed']:.0f}")
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()} {os.cpu_count()} cpus", "pool_copy": copies,
           "resume": res, "logs": base}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
