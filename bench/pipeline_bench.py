#!/usr/bin/env python3
"""Chunked pipeline-parallel prefill (issue 21's table), measured on the multi-host test bed.

Every configuration is a fresh `BedCluster` (master, store node, the prefill side below, one
decode host, the Conductor; every host its own address and IPC namespace, 10 Gbit/s links, one
engine thread per host unless said) serving the real model (SmolLM2-135M, 8K context):

- `one1`: one prefill host, 1 engine thread (the issue's "one host");
- `one2`: one prefill host, 2 engine threads (the same cores as a group of two, in one host);
- `group`: one prefill group of 2 stages on 2 hosts (`--pipeline-group-size 2`), 1 thread each.

Measured in each: streamed TTFT (first content chunk, client on the Conductor's host) of prompts
of about 2K/4K/7K tokens (the 7K one near the model's 8K context) and of a 512-token prompt;
every prompt starts with words of its own (`tag`), so no block of it is cached anywhere (the
cached-tokens header must say 0, and is recorded). In `one1` and `group`: the greedy token ids
of a short completion asked straight from the prefill target over gRPC (`testbed.greedy`).
In `group` only: a sweep of `--pipeline-chunk-tokens` at 7K (the stages restarted per size),
with the pipeline bubble = each stage's idle share inside the prompt
(`mooncake_prefill_stage_bubble_seconds_total` / (busy + bubble), deltas over the request).

The parts run separately (`--part one1,one2` today, `--part group` once the stages exist) and
merge into one JSON; the table judges whatever is there.

Usage: python bench/pipeline_bench.py [--part one1,one2,group] [--sizes 2000,4000,7000]
       [--chunks 64,128,256,512,1024] [--fresh]
Needs root and network namespaces (docs/testbed.md). Writes bench/results/pipeline_bench.json
and .txt (long: a 7K-token prefill on one thread takes minutes on the 2-core dev box).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script: make the `bench` package importable (appended: the repo root holds an
# `operator/` directory that must not shadow the standard library).
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.multihost_bench import BENCH_DIR, WORDS, _met, metric_sum, render, stream_chat
from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig
from mooncake_k8s.testbed.greedy import Job, chat_ids, greedy_ids

MiB = 1 << 20
RATE = "10gbit"
SHORT = 512
GREEDY_TEXT = ("Write one sentence about the sea, then list three colours: "
               + " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(120)))
GREEDY_TOKENS = 6
STAGE_BUSY = "mooncake_prefill_stage_busy_seconds_total"
STAGE_BUBBLE = "mooncake_prefill_stage_bubble_seconds_total"
CONFIGS: dict[str, dict[str, Any]] = {
    "one1": {"prefill": 1, "threads": 1},
    "one2": {"prefill": 1, "threads": 2},
    "group": {"prefill": 0, "threads": 1, "prefill_groups": [2]},
}


def sized_prompt(tag: str, tokens: int) -> str:
    """A chat prompt of `tokens` tokens (with the template, within a few), starting with its
    own words (`tag`): two tags share no KV block."""
    head = f"{tag} {tag} {tag}. Repeat the last word:"

    def text(n: int) -> str:
        return head + " " + " ".join(WORDS[(i * 7 + i // 5 + len(tag)) % len(WORDS)]
                                     for i in range(n))

    n = max(8, tokens // 2)
    for _ in range(6):  # a few secant steps on the word count
        got = len(chat_ids(text(n)))
        if abs(got - tokens) <= 4:
            break
        n = max(8, int(n * tokens / got))
    return text(n)


class Run:
    """One configuration's cluster and its measurements."""

    def __init__(self, c: BedCluster, name: str, nonce: str,
                 echo: Callable[[str], None]) -> None:
        self.c, self.name, self.nonce, self.echo = c, name, nonce, echo
        self.target = c.prefill_targets[0]

    def stage_counters(self) -> dict[str, tuple[float, float]]:
        """(busy, bubble) seconds so far on each stage of group 0 ({} without a group)."""
        out = {}
        for n in self.c.stages(0) if self.c.config.prefill_groups else []:
            url = self.c.metrics_url(n)
            h = self.c.hosts[n]
            out[n] = (h.call(metric_sum, url, STAGE_BUSY), h.call(metric_sum, url, STAGE_BUBBLE))
        return out

    def ttft(self, tokens: int, rep: int, kind: str = "t") -> dict[str, Any]:
        """One streamed request of a new `tokens`-token prompt (`kind` + `rep` make its tag)."""
        text = sized_prompt(f"{self.name}{self.nonce}{kind}{tokens}r{rep}", tokens)
        before = self.stage_counters()
        load = os.getloadavg()[0]  # the box's load: other work skews every number here
        r = self.c.client_call(stream_chat, self.c.base_url, text, 4)
        after = self.stage_counters()
        r["load1"] = max(load, os.getloadavg()[0])
        r["stages"] = {n: {"busy_s": after[n][0] - before[n][0],
                           "bubble_s": after[n][1] - before[n][1]} for n in after}
        for s in r["stages"].values():
            span = s["busy_s"] + s["bubble_s"]
            s["bubble_share"] = s["bubble_s"] / span if span > 0 else None
        self.echo(f"    {self.name} {tokens:>5}: ttft {r['ttft_s']:.2f}s prompt "
                  f"{r['usage'].get('prompt_tokens')} cached {r['cached_tokens']} via "
                  f"{r['prefill']} load {r['load1']:.1f} {_bubbles(r['stages'])}")
        return r

    def ttfts(self, tokens: int, repeats: int) -> dict[str, Any]:
        runs = [self.ttft(tokens, i) for i in range(repeats)]
        return {"tokens": tokens, "runs": runs,
                "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                "prompt_tokens": runs[0]["usage"].get("prompt_tokens"),
                "cached_tokens": max(r["cached_tokens"] for r in runs)}

    def greedy(self) -> dict[str, Any]:
        c = self.c
        (g,) = greedy_ids(c.hosts["conductor"],
                          [Job(c.addr(self.target), GREEDY_TEXT, GREEDY_TOKENS)],
                          c.env(), c.log_dir / "greedy.log")
        text = c.client_call(stream_chat, c.base_url, GREEDY_TEXT, 16)["text"]
        self.echo(f"    {self.name} greedy ids {g['ids']} text {text!r}")
        return {"ids": g["ids"], "cached": g["cached"], "text": text}

    def wait_routed(self, timeout: float = 300.0) -> None:
        """Until the Conductor counts every prefill target ready (after a restart)."""
        url = f"{self.c.base_url}/metrics"
        want = len(self.c.prefill_targets)
        deadline = time.monotonic() + timeout
        while True:
            text = self.c.client_call(_get, url)
            if metric_value(text, "mooncake_conductor_instances",
                            'role="prefill",state="ready"') >= want:
                return
            self.c.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the Conductor never routed to the restarted group")
            time.sleep(0.5)


def _get(url: str) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return str(r.read().decode())


def _loads(part: dict[str, Any]) -> list[float]:
    """Every measured request's 1-minute load average in a part."""
    rows = [r for t in part["ttft"].values() for r in t["runs"]]
    return [float(r["load1"]) for r in rows] + [float(r["load1"]) for r in part.get("sweep", [])]


def _bubbles(stages: dict[str, dict[str, Any]]) -> str:
    parts = [f"{n} busy {s['busy_s']:.1f}s bubble {s['bubble_s']:.1f}s"
             for n, s in stages.items()]
    return ("[" + "; ".join(parts) + "]") if parts else ""


def run_config(name: str, args: argparse.Namespace,
               echo: Callable[[str], None]) -> dict[str, Any]:
    spec = CONFIGS[name]
    cfg = BedConfig(prefill=spec["prefill"], decode=1, rate=RATE, threads=spec["threads"],
                    prefill_groups=list(spec.get("prefill_groups", [])),
                    store_size=768 * MiB, decode_segment_size=768 * MiB,
                    prefill_segment_size=768 * MiB, ready_timeout_s=400,
                    log_dir=tempfile.mkdtemp(prefix=f"pipe-bench-{name}-"))
    echo(f"[{name}] starting the cluster (logs: {cfg.log_dir})")
    t0 = time.monotonic()
    with Testbed() as bed, BedCluster(bed, cfg, echo=lambda _m: None) as c:
        run = Run(c, name, args.nonce, echo)
        run.wait_routed()  # a group is routed to once its leader's check found it whole
        run.ttft(200, 0, "w")  # warm-up: first-call costs off the measured rows
        run.ttft(1000, 0, "w")
        out: dict[str, Any] = {"config": spec, "rate": RATE, "ttft": {}}
        if spec.get("prefill_groups"):
            from mooncake_k8s.prefill.pipeline.config import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNKS

            # the rows before the sweep: the workers' defaults (a prompt cut into about
            # DEFAULT_CHUNKS chunks, none longer than DEFAULT_CHUNK_TOKENS)
            out["chunk_tokens"] = f"auto: {DEFAULT_CHUNKS} chunks <= {DEFAULT_CHUNK_TOKENS}"
        if name != "one2":
            out["greedy"] = run.greedy()
        out["ttft"][str(SHORT)] = run.ttfts(SHORT, 3)
        for n in args.sizes:
            out["ttft"][str(n)] = run.ttfts(n, 2 if n <= 2000 else 1)
        if name == "group" and args.chunks:
            out["sweep"] = sweep(run, args.chunks, max(args.sizes))
        out["wall_s"] = time.monotonic() - t0
        out["max_load1"] = max(_loads(out))
        return out


def sweep(run: Run, chunks: list[int], tokens: int) -> list[dict[str, Any]]:
    """TTFT and bubble at `tokens` per fixed pipeline chunk size (`--pipeline-chunks 0`; the
    group's stages restarted)."""
    rows = []
    run.c.config.pipeline_chunks = 0
    for chunk in chunks:
        run.c.config.pipeline_chunk_tokens = chunk
        run.c.respawn(run.c.stages(0))
        run.wait_routed()
        run.ttft(200, chunk, "w")  # the restarted stages' first call
        r = run.ttft(tokens, chunk, "c")
        shares = [s["bubble_share"] for s in r["stages"].values() if s["bubble_share"] is not None]
        rows.append({"chunk_tokens": chunk, "ttft_s": r["ttft_s"], "stages": r["stages"],
                     "load1": r["load1"],
                     "prompt_tokens": r["usage"].get("prompt_tokens"),
                     "cached_tokens": r["cached_tokens"],
                     "bubble_share": statistics.mean(shares) if shares else None})
    return rows


# -- the table ------------------------------------------------------------------------------


def table(res: dict[str, Any], sizes: list[int]) -> list[list[str]]:
    rows = [["measure", "target", "value", "met"]]
    parts = res.get("parts", {})

    def t(cfg: str, n: int) -> float | None:
        row = parts.get(cfg, {}).get("ttft", {}).get(str(n))
        return float(row["ttft_s"]) if row else None

    chunk = parts.get("group", {}).get("chunk_tokens", "?")
    for n in [SHORT, *sizes]:
        vals = [t(k, n) for k in ("one1", "one2", "group")]
        rows.append([f"TTFT {n} tokens: one host 1 thread / 2 threads / group of 2 "
                     f"(chunk {chunk})", "report",
                     " / ".join(f"{v:.2f}s" if v is not None else "-" for v in vals), "-"])
    big = max(sizes)
    for base, target, limit in (("one1", "<= 0.6x", 0.6), ("one2", "report; <= 1.0x", 1.0)):
        g, b = t("group", big), t(base, big)
        ratio = g / b if g is not None and b else None
        rows.append([f"TTFT {big}: group / {base}", target,
                     f"{ratio:.2f}x" if ratio is not None else "not measured",
                     _met(ratio <= limit) if ratio is not None else "-"])
    g, b = t("group", SHORT), t("one1", SHORT)
    ratio = g / b if g is not None and b else None
    rows.append([f"TTFT {SHORT}: group / one host", "<= 1.15x",
                 f"{ratio:.2f}x" if ratio is not None else "not measured",
                 _met(ratio <= 1.15) if ratio is not None else "-"])
    gi, oi = parts.get("group", {}).get("greedy"), parts.get("one1", {}).get("greedy")
    if gi and oi:
        same = gi["ids"] == oi["ids"] and gi["text"] == oi["text"]
        rows.append(["greedy output group vs one instance (ids, text)", "identical",
                     f"{gi['ids']} vs {oi['ids']}", _met(same)])
    else:
        rows.append(["greedy output group vs one instance", "identical", "not measured", "-"])
    sw = parts.get("group", {}).get("sweep") or []
    for r in sw:
        share = r["bubble_share"]
        rows.append([f"{big}: chunk {r['chunk_tokens']} tokens: TTFT, bubble", "report",
                     f"{r['ttft_s']:.2f}s, " + (f"{share:.0%}" if share is not None else "n/a"),
                     "-"])
    if sw:
        best = min(sw, key=lambda r: r["ttft_s"])
        rows.append([f"fixed chunk size that minimises TTFT at {big}", "report",
                     str(best["chunk_tokens"]), "-"])
        one = t("one1", big)
        if one:
            ratio = best["ttft_s"] / one
            rows.append([f"TTFT {big} at chunk {best['chunk_tokens']}: group / one1", "<= 0.6x",
                         f"{ratio:.2f}x", _met(ratio <= 0.6)])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="one1,one2,group",
                    help="configurations to run now: one1, one2, group (comma-separated)")
    ap.add_argument("--sizes", default="2000,4000,7000", help="long prompts' lengths (tokens)")
    ap.add_argument("--chunks", default="64,128,256,512,1024",
                    help="pipeline chunk sizes of the sweep at the largest size ('' = none)")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "pipeline_bench"))
    ap.add_argument("--fresh", action="store_true", help="drop earlier parts in --out's JSON")
    args = ap.parse_args()
    # SIGTERM (or SIGINT from a background job, where it is ignored) ends the run through the
    # `with` blocks: the bed's processes and namespaces go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    args.chunks = [int(x) for x in args.chunks.split(",") if x]
    args.nonce = f"{int(time.time()) % 100000}"
    path = Path(args.out + ".json")
    res: dict[str, Any] = ({} if args.fresh or not path.exists()
                           else json.loads(path.read_text()))
    res.update({"bench": "pipeline_bench", "sizes": args.sizes,
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                           f"kernel {platform.release()}"})
    res.setdefault("parts", {})
    for name in [p for p in args.part.split(",") if p]:
        if name not in CONFIGS:
            ap.error(f"--part: unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
        part = run_config(name, args, print)
        part["date"] = datetime.datetime.now(datetime.UTC).isoformat()
        res["parts"][name] = part
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")  # each part kept
    text = render(table(res, args.sizes))
    print(text)
    dates = ", ".join(f"{k} {v.get('date', '?')[:16]} (load <= {v.get('max_load1', 0):.1f})"
                      for k, v in res["parts"].items())
    Path(args.out + ".txt").write_text(f"{res['machine']}; measured {dates}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
