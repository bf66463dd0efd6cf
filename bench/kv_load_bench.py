#!/usr/bin/env python3
"""KV load benchmark: a prompt's KV from a segment on the same host into the embedded engine.

Issue 20 asks loading a prompt's KV into the engine from a segment on the same host to reach
>= 2 GB/s, for decode (admission) and for prefill (import of cached blocks). The store and the
model are real: a master and one storage node (a DRAM segment) as processes on loopback, the
built-in model (SmolLM2-135M, fp32 on CPU). A real prefill computes each prompt's KV once and
stores its blocks in the node's segment; every timed load then reads them over shared memory.

- decode: `EmbeddedDecode.decode()` of the prompt with max_tokens=2 (one step). Time = from the
  call to the sequence's admission (KV read from the store, verified, copied into the engine's
  cache): the first token's arrival minus the duration of the step that produced it. The
  engine's own figure (`load_seconds()`, call -> admitted) is kept in the JSON too.
- prefill: the import that `Engine.prefill` does before computing: the plan's blocks read into
  the prefill's staging (`EmbeddedPrefill._read`), then verified and copied into its KV buffer
  (`Engine._import`).
- repeat: the same keys read again (the pages of the segment are mapped in this process
  already); fresh: the same KV put under keys this process never read, before each round
  (untimed), removed after it, so the reads touch segment pages new to this process.

GB/s = 1e9 B/s of block bytes (headers included) over the wall time; the median over rounds,
min and max beside it. The first load of a process (nothing reused yet) is its own row.
Reference, in the same run: memcpy (np.copyto) of the same number of bytes between two
buffers touched before.

Usage: python bench/kv_load_bench.py [--tokens 1024,2880] [--rounds 5] [--threads 1]
(about 1-2 minutes on 2 cores: the cold prefills dominate). Writes
bench/results/kv_load_bench.json and .txt.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import DecodeWork, KVPlan, PrefillWork
from mooncake_k8s.engine.embedded import EngineConfig
from mooncake_k8s.engine.embedded.adapter import EmbeddedDecode
from mooncake_k8s.engine.embedded.prefill import EmbeddedPrefill
from mooncake_k8s.engine.embedded.testing import prompt_tokens
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import store_cluster

BENCH_DIR = Path(__file__).resolve().parent
SAMPLING = pb.Sampling(temperature=0, max_tokens=2)


class Prompt:
    """One prompt's real KV blocks (fetched back after its prefill) and its first token."""

    def __init__(self, pre: EmbeddedPrefill, store: StoreClient, n: int) -> None:
        self.n = n
        self.tokens = prompt_tokens(pre.engine, n)
        self.keys = pre.engine.block_keys(self.tokens)
        done = pre.prefill(PrefillWork(f"cold-{n}", self.tokens, "", SAMPLING,
                                       KVPlan(tuple(self.keys))))
        self.first = done.first_token
        self.tail = done.tail_key
        self.blocks = [bytes(store.get(k)) for k in self.keys]
        self.nbytes = sum(map(len, self.blocks)) + (len(store.get(self.tail)) if self.tail else 0)

    def variant(self, pre: EmbeddedPrefill, store: StoreClient,
                v: int) -> tuple[list[int], list[str]]:
        """The same KV under the keys of the prompt with another first token (stored now):
        keys chain, so every key differs from the prompt's and from other variants'."""
        tokens = [1 + v % (pre.engine.vocab_size - 1), *self.tokens[1:]]
        keys = pre.engine.block_keys(tokens)
        store.remove(keys, force=True)
        errors = store.batch_put(keys, self.blocks)
        if any(e is not None for e in errors):
            raise RuntimeError(f"storing variant {v}: {errors}")
        return tokens, keys


def _decode_once(dec: EmbeddedDecode, p: Prompt, tokens: list[int], keys: list[str],
                 rid: str) -> tuple[float, float | None]:
    """Seconds from decode()'s call to the admission (first token minus its step), and the
    engine's own figure when it has one. Full blocks only: the tail was read and removed by
    the first decode, and the prompt is cut to its full blocks accordingly."""
    full = tokens[: len(keys) * dec.engine.block_tokens]
    work = DecodeWork(rid, full, "", p.first, SAMPLING, keys, "")
    dec.step_seconds()
    t0 = time.perf_counter()
    first = None
    for _ in dec.decode(work, threading.Event()):
        first = first or time.perf_counter()
    assert first is not None
    step = dec.step_seconds()[0]
    own = dec.load_seconds() if hasattr(dec, "load_seconds") else []
    return first - t0 - step, (own[0][0] if own else None)


def _import_once(pre: EmbeddedPrefill, keys: list[str]) -> float:
    """Seconds for the prefill's import of `keys`: read into staging, verify, copy."""
    eng = pre.engine
    t0 = time.perf_counter()
    try:
        blocks = pre._read(keys, "")
    except TypeError:  # the tree before keep_on (for the before numbers)
        blocks = pre._read(keys)  # type: ignore[call-arg]
    kv = eng._scratch_kv(len(keys) * eng.block_tokens)
    with torch.inference_mode():
        try:
            used = eng._import(kv, blocks, "bench", True)
        except TypeError:
            used = eng._import(kv, blocks, "bench")  # type: ignore[call-arg]
    dt = time.perf_counter() - t0
    if used != len(keys):
        raise RuntimeError(f"prefill imported {used} of {len(keys)} blocks")
    return dt


def _memcpy_gbps(nbytes: int, rounds: int) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def _stats(nbytes: int, times: list[float]) -> dict[str, Any]:
    rates = [nbytes / t / 1e9 for t in times]
    return {"seconds": times, "gb_s": statistics.median(rates), "min_gb_s": min(rates),
            "max_gb_s": max(rates)}


def measure(pre: EmbeddedPrefill, dec: EmbeddedDecode, store: StoreClient, p: Prompt,
            rounds: int, first: bool) -> dict[str, Any]:
    """Every row of one prompt size; decode and prefill alternate within each round so a busy
    moment of the shared machine hits both alike."""
    full = sum(map(len, p.blocks))
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("decode repeat", "prefill repeat", "decode fresh",
                                     "prefill fresh")}
    own: list[float] = []
    calls: dict[str, Callable[[int], float]] = {
        "decode repeat": lambda r: _record(own, _decode_once(dec, p, p.tokens, p.keys,
                                                              f"rep-{p.n}-{r}")),
        "prefill repeat": lambda r: _import_once(pre, p.keys),
    }
    out: dict[str, Any] = {"tokens": p.n, "blocks": len(p.keys), "bytes": full}
    if first:  # nothing reused yet in this process
        out["decode first"] = _stats(full, [calls["decode repeat"](-1)])
        out["prefill first"] = _stats(full, [calls["prefill repeat"](-1)])
    else:
        calls["decode repeat"](-1)
        calls["prefill repeat"](-1)
    own.clear()
    for r in range(rounds):
        for name, call in calls.items():
            rows[name].append(call(r))
        for name, path in (("decode fresh", "d"), ("prefill fresh", "p")):
            tokens, keys = p.variant(pre, store, 100 * p.n + 2 * r + (path == "p"))
            if path == "d":
                rows[name].append(_record(own, _decode_once(dec, p, tokens, keys,
                                                            f"fresh-{p.n}-{r}")))
            else:
                rows[name].append(_import_once(pre, keys))
            store.remove(keys, force=True)
    out.update({name: _stats(full, ts) for name, ts in rows.items()})
    out["decode engine-measured gb_s"] = (statistics.median(full / t / 1e9 for t in own)
                                          if own else None)
    out["memcpy gb_s"] = _memcpy_gbps(full, rounds)
    return out


def _record(own: list[float], result: tuple[float, float | None]) -> float:
    if result[1] is not None:
        own.append(result[1])
    return result[0]


def run(sizes: list[int], rounds: int, threads: int) -> dict[str, Any]:
    segment = max(sizes) * 3 * 48 * 1024 + (256 << 20)  # ~3 prompts' KV and room
    results = []
    with store_cluster(nodes=1, dram_size=f"{segment >> 20}MiB") as cluster, \
            cluster.client() as store:
        cfg = EngineConfig(threads=threads, layerwise_kv=False)
        pre, dec = EmbeddedPrefill(cfg, store), EmbeddedDecode(cfg, store)
        try:
            prompts = [Prompt(pre, store, n) for n in sizes]
            for i, p in enumerate(prompts):
                results.append(measure(pre, dec, store, p, rounds, first=i == 0))
        finally:
            dec.close()
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                       f"kernel {platform.release()}, torch {torch.__version__}",
            "python": platform.python_version(), "rounds": rounds, "torch_threads": threads,
            "model": "SmolLM2-135M fp32 (built-in), CPU", "results": results}


ROWS = ("decode first", "prefill first", "decode repeat", "prefill repeat", "decode fresh",
        "prefill fresh")


def table(doc: dict[str, Any]) -> str:
    """One line per prompt size and row: GB/s (median, min-max), ms, and memcpy beside it."""
    head = (f"{'tokens':>6} {'MB':>6} {'row':<15} {'GB/s':>6} {'min-max GB/s':>13} "
            f"{'ms (median)':>11} {'memcpy GB/s':>11} {'% memcpy':>8}")
    lines = [f"kv_load_bench {doc['date']}  {doc['machine']}",
             f"{doc['model']}, {doc['torch_threads']} torch thread(s), {doc['rounds']} rounds; "
             "target >= 2 GB/s", head, "-" * len(head)]
    for res in doc["results"]:
        mem = res["memcpy gb_s"]
        for row in ROWS:
            if row not in res:
                continue
            s = res[row]
            ms = 1e3 * statistics.median(s["seconds"])
            lines.append(f"{res['tokens']:>6} {res['bytes'] / 1e6:>6.1f} {row:<15} "
                         f"{s['gb_s']:>6.2f} {s['min_gb_s']:>6.2f}-{s['max_gb_s']:<6.2f} "
                         f"{ms:>11.1f} {mem:>11.2f} {100 * s['gb_s'] / mem:>7.0f}%")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,2880", help="prompt sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engines')")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "kv_load_bench"))
    args = ap.parse_args()
    doc = run([int(t) for t in args.tokens.split(",")], args.rounds, args.threads)
    text = table(doc)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
