"""How long a healthy decode stream goes between tokens: the measurement behind the Conductor's
`--stream-stall-timeout` default (a stream silent longer is resumed elsewhere).

A loopback cluster (`mooncake up`: 1 prefill, 2 decode, the built-in model, the deadline off so
nothing is resumed) serves waves of streams that start while others run, so decode admits new
sequences (loads their KV) between the running ones' steps, the busiest case a healthy stream
sees. The client times every SSE chunk (one per token); the gap after a stream's first token
is what the deadline watches. Prints a table and writes JSON.

    python bench/stream_gaps.py [--streams 12] [--tokens 128] [--out bench/results/stream_gaps.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from typing import Any

import openai

from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor"]


def _stream(url: str, seed: int, tokens: int, out: list[float]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    prompt = f"Log {seed}: " + " ".join(WORDS[(i * 3 + seed) % 8] for i in range(100 + seed))
    for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        if ch.choices:
            out.append(time.monotonic())


def measure(streams: int, tokens: int, stagger_s: float) -> dict[str, Any]:
    cfg = UpConfig(port=0, prefill=1, decode=2, store_size=256 << 20, threads=1,
                   log_dir=tempfile.mkdtemp(prefix="stream-gaps-"), ready_timeout_s=600,
                   stream_stall_timeout_s=0)
    times: list[list[float]] = [[] for _ in range(streams)]
    with LocalCluster(cfg, echo=lambda _m: None) as c:
        threads = []
        for i in range(streams):
            t = threading.Thread(target=_stream, args=(c.base_url, i, tokens, times[i]))
            t.start()
            threads.append(t)
            time.sleep(stagger_s)
        for t in threads:
            t.join()
    # Gaps after the first decode chunk (the deadline starts there): from the 2nd token on.
    gaps = sorted(b - a for ts in times for a, b in itertools.pairwise(ts[1:]))
    q = statistics.quantiles(gaps, n=1000)
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{os.uname().machine} {os.cpu_count()} cpus",
            "streams": streams, "tokens": tokens, "stagger_s": stagger_s,
            "complete": sum(len(ts) == tokens for ts in times), "gaps": len(gaps),
            "gap_p50_ms": 1000 * q[499], "gap_p99_ms": 1000 * q[989],
            "gap_p999_ms": 1000 * q[998], "gap_max_ms": 1000 * gaps[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stagger", type=float, default=0.25)
    ap.add_argument("--out", default="bench/results/stream_gaps.json")
    a = ap.parse_args()
    r = measure(a.streams, a.tokens, a.stagger)
    for k in ("streams", "complete", "gaps", "gap_p50_ms", "gap_p99_ms", "gap_p999_ms",
              "gap_max_ms"):
        v = r[k]
        print(f"{k:14s} {v:10.1f}" if isinstance(v, float) else f"{k:14s} {v:10d}")
    with open(a.out, "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
