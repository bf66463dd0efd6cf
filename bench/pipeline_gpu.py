#!/usr/bin/env python3
"""Pipeline stages on a GPU: is a 2-stage split of the embedded engine's forward pass bit-exact
there too, and what would chunked pipeline prefill buy for a Llama-3-8B shape?

No 8B weights can be downloaded where this runs, so the model is built from a
Llama-3.1-8B-shaped config.json with random bf16 weights (the arithmetic is the real model's).
One process, one GPU: both "stages" run on it, one after the other, so nothing here measures a
network or two GPUs working at once. What it measures:

  exact          the single instance's KV and last hidden state equal, bit for bit, those of
                 stage 0 (layers [0, L/2)) feeding stage 1 (layers [L/2, L)) chunk by chunk,
                 with the hidden states passed through host bytes as the runtime passes them
                 (the CUDA fused-attention path; the CPU path is checked in the unit tests)
  single_ms      one instance's prefill of the prompt (all layers, chunks of --chunk tokens)
  stage_ms       each stage's time per chunk, summed
  pipe_ms        the 2-stage pipeline's TTFT from those measured per-chunk times: stage 1 runs
                 chunk i after stage 0 finished it and after its own chunk i-1 (compute only:
                 a modelled schedule, no network; hidden states per chunk = chunk x hidden x 2
                 bytes, reported as hidden_mb for a link budget)
  ratio          pipe_ms / single_ms

  python bench/pipeline_gpu.py                        # 8K and 32K tokens, chunks 1K..8K
  python bench/pipeline_gpu.py --smoke                # tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Run as a script: make the `bench` package importable (appended: the repo root's operator/
# folder must not shadow the standard library), as store_bench does.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import LLAMA3_8B


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


def _stage_kv(model: Any, lo: int, hi: int, n: int) -> torch.Tensor:
    shape = (hi - lo, 2, model.num_kv_heads, n, model.head_dim)
    return torch.empty(shape, device=model.device, dtype=model.dtype)


def exact(model: Any, ids: torch.Tensor, chunk: int) -> bool:
    """Single instance vs 2 stages (hidden states through host bytes): identical bits?"""
    n, layers, mid = ids.numel(), model.num_layers, model.num_layers // 2
    kv = _stage_kv(model, 0, layers, n)
    kv0, kv1 = _stage_kv(model, 0, mid, n), _stage_kv(model, mid, layers, n)
    last = last_p = None
    with torch.inference_mode():
        for s, e in _chunks(n, chunk):
            last = model.run_layers(model.embed_ids(ids[s:e]), s, kv, 0, layers)[-1:]
            h = model.run_layers(model.embed_ids(ids[s:e]), s, kv0, 0, mid)
            wire = h.contiguous().cpu().view(torch.uint8).numpy().tobytes()
            h = torch.frombuffer(bytearray(wire), dtype=torch.uint8).view(model.dtype)
            h = h.view(e - s, model.hidden).to(model.device)
            last_p = model.run_layers(h, s, kv1, mid, layers)[-1:]
        _sync(model.device)
        assert last is not None and last_p is not None
        return bool(torch.equal(kv[:mid], kv0) and torch.equal(kv[mid:], kv1)
                    and torch.equal(last, last_p))


def timed_stages(model: Any, ids: torch.Tensor, chunk: int) -> dict[str, Any]:
    """Per-chunk times of the whole model and of each half, then the 2-stage schedule."""
    n, layers, mid = ids.numel(), model.num_layers, model.num_layers // 2
    kv = _stage_kv(model, 0, layers, n)
    kv0, kv1 = _stage_kv(model, 0, mid, n), _stage_kv(model, mid, layers, n)
    single, t0s, t1s = 0.0, [], []
    with torch.inference_mode():
        for s, e in _chunks(n, chunk):
            _sync(model.device)
            t = time.perf_counter()
            model.run_layers(model.embed_ids(ids[s:e]), s, kv, 0, layers)
            _sync(model.device)
            single += time.perf_counter() - t
            t = time.perf_counter()
            h = model.run_layers(model.embed_ids(ids[s:e]), s, kv0, 0, mid)
            _sync(model.device)
            t0s.append(time.perf_counter() - t)
            t = time.perf_counter()
            model.run_layers(h, s, kv1, mid, layers)
            _sync(model.device)
            t1s.append(time.perf_counter() - t)
    done0 = done1 = 0.0
    for a, b in zip(t0s, t1s, strict=True):
        done0 += a
        done1 = max(done0, done1) + b
    return {
        "prompt_tokens": n, "chunk": chunk, "single_ms": round(single * 1e3, 1),
        "stage0_ms": round(sum(t0s) * 1e3, 1), "stage1_ms": round(sum(t1s) * 1e3, 1),
        "pipe_ms": round(done1 * 1e3, 1), "ratio": round(done1 / single, 3),
        "hidden_mb": round(chunk * model.hidden * model.dtype.itemsize / 1e6, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    shape, device = dict(LLAMA3_8B), "cuda"
    if args.smoke:
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
        device, args.sizes, args.chunks = "cpu", "512", "128,256"
    elif not torch.cuda.is_available():
        print("pipeline_gpu: no CUDA device (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    from mooncake_k8s.engine import EngineConfig, load_engine

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(shape))
        engine = load_engine(EngineConfig(
            model=d, served_name="llama3-8b-shape-random", random_weights=True, device=device,
            dtype="bfloat16", kv_capacity_tokens=1024), progress=False)
    model = engine.model
    gen = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    ids_all = torch.randint(0, model.vocab, (max(sizes),), generator=gen).to(model.device)
    checks = {f"{n}@{c}": exact(model, ids_all[:n], c)
              for n in sizes[:1] for c in chunks[:2]}
    print(f"attention path {model._fused!r}; bit-exact 2-stage split: {checks}", flush=True)
    timed_stages(model, ids_all[: min(sizes)], chunks[0])  # warm-up
    rows = [timed_stages(model, ids_all[:n], c) for n in sizes for c in chunks if c <= n]
    cols = list(rows[0])
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>13}" for c in cols))
    out = {"exact": checks, "rows": rows, "meta": {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__, "attention": model._fused,
        "model": "Llama-3.1-8B shape, random bf16 weights", "date": time.strftime("%Y-%m-%d")}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
