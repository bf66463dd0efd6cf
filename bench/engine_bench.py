#!/usr/bin/env python3
"""Embedded-engine benchmark: prefill, full-prefix-hit prefill, block import, decode steps.

Runs the engine in-process with the built-in SmolLM2-135M (or --model) and, in the same run,
the strongest peer at hand on the same machine: the Hugging Face transformers forward pass of
the same weights (prefill: one forward over the prompt; decode: batched forward with its
DynamicCache, left-padded). Prints a table and writes JSON.

  python bench/engine_bench.py                 # 512/2048/4096 tokens, batches 1/8/32
  python bench/engine_bench.py --quick         # 512/2048 tokens, batches 1/8
  python bench/engine_bench.py --json out.json --threads 2

Rows:
  prefill   cold TTFT (compute + first token, no export) and tokens/s; `export_ms` = encoding
            the new blocks; `hit_ms` = full-prefix hit (verify + import every block, recompute
            the last token); `import_ms` = verify + import alone; ratio = hit/cold.
  decode    one step for B running sequences of `--decode-context` tokens each: ms/step and
            tokens/s, ours vs HF.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _prompt(engine: Any, n: int) -> list[int]:
    """n real-text tokens (the repo's own docs, repeated as needed)."""
    root = Path(__file__).resolve().parent.parent
    text = "\n".join(p.read_text() for p in sorted(root.glob("**/*.md"))[:20])
    ids: list[int] = engine.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def bench_prefill(engine: Any, hf: Any, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    from mooncake_k8s.engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    rows = []
    for n in sizes:
        ids = _prompt(engine, n)
        engine.prefill(ids[:64], [], greedy, export=False)  # warm-up
        cold = _median_ms(lambda ids=ids: engine.prefill(ids, [], greedy, export=False), reps)
        t = time.perf_counter()
        res = engine.prefill(ids, [], greedy)
        with_export = (time.perf_counter() - t) * 1e3
        blocks = [b for _, b in res.new_blocks]
        hit_res = engine.prefill(ids, blocks, greedy)
        assert hit_res.first_token == res.first_token and hit_res.cached_tokens == n - 1
        hit = _median_ms(lambda ids=ids, b=blocks: engine.prefill(ids, b, greedy), max(reps, 5))
        with torch.inference_mode():
            kv = engine._scratch_kv(n)
            imp = _median_ms(lambda b=blocks, kv=kv: engine._import(kv, b, "bench"), max(reps, 5))
        row: dict[str, Any] = {
            "prompt_tokens": n,
            "cold_ttft_ms": round(cold, 1),
            "tokens_per_s": round(n / cold * 1e3, 1),
            "export_ms": round(max(0.0, with_export - cold), 1),
            "hit_ttft_ms": round(hit, 1),
            "import_ms": round(imp, 1),
            "import_blocks": len(blocks),
            "ratio": round(hit / cold, 4),
        }
        if hf is not None:
            tensor = torch.tensor([ids])
            with torch.inference_mode():
                row["hf_cold_ms"] = round(_median_ms(lambda t=tensor: hf(t), reps), 1)
        rows.append(row)
        print(f"  prefill {n}: {row}", file=sys.stderr)
    return rows


def bench_decode(
    engine: Any, hf: Any, batches: list[int], context: int, steps: int
) -> list[dict[str, Any]]:
    from mooncake_k8s.engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=steps + 2)
    ids = _prompt(engine, context)
    res = engine.prefill(ids, [], greedy)
    blocks = [b for _, b in res.new_blocks] + ([res.tail_block] if res.tail_block else [])
    rows = []
    for b in batches:
        for i in range(b):
            engine.add_sequence(f"s{i}", ids, blocks, res.first_token, greedy)
        engine.step()  # warm-up
        ms = _median_ms(engine.step, steps)
        for i in range(b):
            engine.abort(f"s{i}")
        row: dict[str, Any] = {
            "batch": b,
            "context": context,
            "step_ms": round(ms, 1),
            "tokens_per_s": round(b / ms * 1e3, 1),
        }
        if hf is not None:
            row["hf_step_ms"] = round(_hf_decode(hf, ids, b, steps), 1)
        rows.append(row)
        print(f"  decode B={b}: {row}", file=sys.stderr)
    return rows


def _hf_decode(hf: Any, ids: list[int], b: int, steps: int) -> float:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        out = hf(torch.tensor([ids] * b), past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _table(prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> str:
    lines = [
        "prefill (ms)",
        f"{'tokens':>7} {'cold':>8} {'tok/s':>7} {'HF cold':>8} {'export':>7} {'hit':>7}"
        f" {'import':>7} {'blocks':>6} {'hit/cold':>8}",
    ]
    for r in prefill:
        lines.append(
            f"{r['prompt_tokens']:>7} {r['cold_ttft_ms']:>8} {r['tokens_per_s']:>7}"
            f" {r.get('hf_cold_ms', '-'):>8} {r['export_ms']:>7} {r['hit_ttft_ms']:>7}"
            f" {r['import_ms']:>7} {r['import_blocks']:>6} {r['ratio']:>8}"
        )
    lines += ["", "decode step (ms)", f"{'batch':>5} {'ctx':>5} {'ours':>7} {'tok/s':>7} {'HF':>7}"]
    for r in decode:
        lines.append(
            f"{r['batch']:>5} {r['context']:>5} {r['step_ms']:>7} {r['tokens_per_s']:>7}"
            f" {r.get('hf_step_ms', '-'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: built-in SmolLM2)")
    ap.add_argument("--quick", action="store_true", help="512/2048 tokens, batches 1/8")
    ap.add_argument("--sizes", default=None, help="prompt sizes, e.g. 512,2048,4096")
    ap.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,8,32")
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-peer", action="store_true", help="skip the HF transformers rows")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    default_sizes = "512,2048" if args.quick else "512,2048,4096"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    batches = [int(s) for s in (args.batches or ("1,8" if args.quick else "1,8,32")).split(",")]

    from mooncake_k8s.engine import EngineConfig, load_engine
    from mooncake_k8s.engine.loading import ensure_builtin

    t = time.perf_counter()
    engine = load_engine(EngineConfig(model=args.model, threads=args.threads), progress=True)
    load_s = time.perf_counter() - t
    hf: Any = None
    if not args.no_peer:
        from transformers import AutoModelForCausalLM

        path = args.model or str(ensure_builtin(progress=False)[0])
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.eval()
    prefill = bench_prefill(engine, hf, sizes, args.reps)
    decode = bench_decode(engine, hf, batches, args.decode_context, 8)
    print(_table(prefill, decode))
    result = {
        "prefill": prefill,
        "decode": decode,
        "meta": {
            "model": engine.served_name,
            "device": str(engine.device),
            "dtype": engine.dtype_name,
            "threads": torch.get_num_threads(),
            "load_s": round(load_s, 2),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
