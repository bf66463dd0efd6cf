#!/usr/bin/env python3
"""Engine reuse table on a GPU: cold prefill TTFT vs full-prefix-hit TTFT for a Llama-3-8B shape.

No 8B weights can be downloaded where this runs, so the engine builds the model from a
Llama-3.1-8B-shaped config.json with random weights (`EngineConfig(random_weights=True)`):
the arithmetic and the bytes moved are those of the real model, the tokens are meaningless.

For each prompt length (default 8K and 32K tokens):
  cold_ttft_ms   prefill of the whole prompt to the first token (no block export), median
  cold64_ttft_ms the same with 64-token chunks (the bit-exact canonical setting), one run
  export_ms      encoding every block to host bytes (what a cold prefill adds for the store)
  load_ms        verify (xxh3, thread pool) + copy every block from pinned host memory into
                 the GPU KV cache: the engine's import alone
  h2d_ms         the same bytes copied host->GPU with nothing else: the PCIe floor
  hit_ttft_ms    full-prefix hit: import every block + recompute the last token, median
  ratio          hit / cold;  floor = h2d / cold (what a perfect import would give)

  python bench/engine_gpu.py                         # 8192,32768 tokens, chunk 4096
  python bench/engine_gpu.py --sizes 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any) -> tuple[float, Any]:
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return (time.perf_counter() - t) * 1e3, out


def _median(fn: Any, reps: int) -> float:
    return statistics.median(_timed(fn)[0] for _ in range(reps))


def _check_attention(engine: Any) -> tuple[float, float]:
    """Relative error against float32 of one chunk's attention through the fused path and
    through the masked (CPU) formulation, on the same random bf16 inputs."""
    model = engine.model
    n, end = 256, 1024
    dev, dt = engine.device, model.dtype
    q = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)
    keys = torch.randn(1, model.num_kv_heads, end, model.head_dim, device=dev, dtype=dt)
    values = torch.randn_like(keys)

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qpos = (torch.arange(n, device=dev) + end - n).repeat(model.groups)
        mask = torch.arange(end, device=dev)[None, :] <= qpos[:, None]
        g = torch.nn.functional.scaled_dot_product_attention(model._group(q), k, v, attn_mask=mask)
        return model._ungroup(g[0], n)  # type: ignore[no-any-return]

    with torch.inference_mode():
        ref = masked(q.float(), keys.float(), values.float())
        fused = model._attend_fused(q, keys, values) if model._fused else masked(q, keys, values)
        plain = masked(q, keys, values)

    def rel(x: torch.Tensor) -> float:
        return float((x.float() - ref).norm() / ref.norm())

    return rel(fused), rel(plain)


def _profile_hit(engine: Any, ids: list[int], views: list[Any]) -> dict[str, float]:
    """Where a full hit's time goes (each phase synchronised)."""
    n = len(ids)
    out: dict[str, float] = {}
    with torch.inference_mode():
        out["check_ms"], _ = _timed(lambda: engine._check_tokens(ids))
        kv = engine._scratch_kv(n)
        out["import_ms"], _ = _timed(lambda: engine._import(kv, views, "profile"))
        out["last_token_ms"], logits = _timed(
            lambda: engine.model.forward_single(ids[-1], n - 1, kv))
        out["sample_ms"], _ = _timed(lambda: int(logits[0].argmax()))
    return {k: round(v, 2) for k, v in out.items()}


def run_size(engine: Any, n: int, reps: int) -> dict[str, Any]:
    from mooncake_k8s.common.blocks import HEADER_SIZE
    from mooncake_k8s.engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=4)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist()

    engine.prefill(ids[: 2 * engine.chunk_tokens], [], greedy, export=False)  # warm-up
    cold = _median(lambda: engine.prefill(ids, [], greedy, export=False), reps)
    _log(f"{n}: cold {cold:.0f} ms")
    chunk = engine.chunk_tokens
    engine.chunk_tokens = engine.block_tokens
    cold64, _ = _timed(lambda: engine.prefill(ids, [], greedy, export=False))
    engine.chunk_tokens = chunk
    _log(f"{n}: cold with {engine.block_tokens}-token chunks {cold64:.0f} ms")

    with_export, res = _timed(lambda: engine.prefill(ids, [], greedy))
    with torch.inference_mode():
        cold_kv = engine._scratch[:, :, :, :n].clone()
    blocks = [b for _, b in res.new_blocks]
    size = len(blocks[0])
    pin = torch.cuda.is_available()
    pinned = torch.empty(len(blocks) * size, dtype=torch.uint8, pin_memory=pin)
    views = []
    for i, b in enumerate(blocks):
        v = pinned[i * size : (i + 1) * size]
        v.copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        views.append(v)
    del blocks, res
    total = pinned.numel()
    _log(f"{n}: export {with_export - cold:.0f} ms, {len(views)} blocks, {total / 1e9:.2f} GB")

    dst: torch.Tensor | None = torch.empty(total, dtype=torch.uint8, device=engine.device)
    h2d = _median(lambda d=dst: d.copy_(pinned, non_blocking=True), 5)  # type: ignore[union-attr]
    payloads = [v[HEADER_SIZE:] for v in views]
    dst = None

    def load() -> int:
        with torch.inference_mode():
            return int(engine._import(engine._scratch_kv(n), views, "bench"))

    load_ms = _median(load, 5)
    assert load() == len(views)

    def strided_copy() -> None:
        with torch.inference_mode():
            kv = engine._scratch_kv(n)
            shape = engine.model.kv_shape(engine.block_tokens)
            for i, p in enumerate(payloads):
                engine.codec.copy_in(kv, i * engine.block_tokens, p.view(engine.codec.dtype)
                                     .view(shape))

    copy_ms = _median(strided_copy, 5)
    hit_res = engine.prefill(ids, views, greedy)
    assert hit_res.cached_tokens == n - 1 and hit_res.rejected_blocks == 0
    with torch.inference_mode():
        kv_identical = bool(torch.equal(engine._scratch[:, :, :, :n], cold_kv))
    cold_kv = None
    hit = _median(lambda: engine.prefill(ids, views, greedy), max(reps, 5))
    phases = _profile_hit(engine, ids, views)
    k = min(64, len(views))  # 4096 tokens: pinned vs pageable host memory
    short = ids[: k * engine.block_tokens]
    pageable = [bytes(v.numpy()) for v in views[:k]]
    hit_pageable = _median(lambda p=pageable: engine.prefill(short, p, greedy), 3)
    hit_pinned_4k = _median(lambda: engine.prefill(short, views[:k], greedy), 3)
    pageable = []
    ref = engine.prefill(ids, [], greedy, export=False)
    row = {
        "prompt_tokens": n,
        "cold_ttft_ms": round(cold, 1),
        "cold64_ttft_ms": round(cold64, 1),
        "hit_ttft_ms": round(hit, 1),
        "ratio": round(hit / cold, 4),
        "load_ms": round(load_ms, 1),
        "copy_ms": round(copy_ms, 1),
        "h2d_ms": round(h2d, 1),
        "floor_ratio": round(h2d / cold, 4),
        "export_ms": round(with_export - cold, 1),
        "kv_gb": round(total / 1e9, 3),
        "h2d_gbps": round(total / h2d / 1e6, 1),
        "prefill_tokens_per_s": round(n / cold * 1e3),
        "same_first_token": hit_res.first_token == ref.first_token,
        "kv_identical_after_import": kv_identical,
        "hit_phases": phases,
        "hit_4096_pinned_ms": round(hit_pinned_4k, 1),
        "hit_4096_pageable_ms": round(hit_pageable, 1),
    }
    _log(f"{n}: {row}")
    return row


def run_decode(engine: Any, batches: list[int], context: int, steps: int) -> list[dict[str, Any]]:
    """ms per decode step with B sequences of `context` tokens (KV handed over as blocks)."""
    from mooncake_k8s.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    ids = torch.randint(0, engine.vocab_size, (context,), generator=torch.Generator()
                        .manual_seed(7)).tolist()
    res = engine.prefill(ids, [], params)
    blocks = [b for _, b in res.new_blocks] + ([res.tail_block] if res.tail_block else [])
    rows = []
    for b in batches:
        for i in range(b):
            engine.add_sequence(f"d{i}", ids, blocks, res.first_token, params)
        engine.step()
        ms = _median(engine.step, steps)
        for i in range(b):
            engine.abort(f"d{i}")
        rows.append({"batch": b, "context": context, "step_ms": round(ms, 2),
                     "tokens_per_s": round(b / ms * 1e3, 1)})
        _log(f"decode {rows[-1]}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on the CPU: checks this script, measures nothing useful")
    args = ap.parse_args(argv)
    shape, device = dict(LLAMA3_8B), "cuda"
    if args.smoke:
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
        device, args.sizes, args.chunk, args.reps = "cpu", "256,512", 128, 1
    elif not torch.cuda.is_available():
        print("engine_gpu: no CUDA device; nothing to measure (--smoke runs on the CPU)",
              file=sys.stderr)
        return 2

    from mooncake_k8s.engine import EngineConfig, load_engine

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(shape))
        cfg = EngineConfig(
            model=d, served_name="llama3-8b-shape-random", random_weights=True, device=device,
            dtype="bfloat16", prefill_chunk_tokens=args.chunk, kv_capacity_tokens=65536,
        )
        t = time.perf_counter()
        engine = load_engine(cfg, progress=False)
        load_s = time.perf_counter() - t
    gpu_gb = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else 0.0
    _log(f"engine ready in {load_s:.1f} s; {gpu_gb:.1f} GB on the GPU")
    rel_fused, rel_masked = _check_attention(engine)
    _log(f"attention mode {engine.model._fused!r}: rel. error vs fp32 {rel_fused:.2e} "
         f"(masked formulation {rel_masked:.2e})")
    rows = [run_size(engine, int(s), args.reps) for s in args.sizes.split(",")]

    cols = ("prompt_tokens", "cold_ttft_ms", "cold64_ttft_ms", "hit_ttft_ms", "ratio", "load_ms",
            "h2d_ms", "floor_ratio", "export_ms", "kv_gb", "h2d_gbps")
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>14}" for c in cols))
    result: dict[str, Any] = {
        "reuse": rows,
        "meta": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
            "torch": torch.__version__,
            "model": "Llama-3.1-8B shape, random bf16 weights",
            "chunk_tokens": args.chunk,
            "block_tokens": engine.block_tokens,
            "verify_threads": engine.codec._threads,
            "cpu_count": os.cpu_count(),
            "fused_attention": engine.model._fused,
            "attention_rel_error_fused": rel_fused,
            "attention_rel_error_masked": rel_masked,
            "load_s": round(load_s, 1),
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    try:
        batches = [1, 8] if args.smoke else [1, 8, 32]
        result["decode"] = run_decode(engine, batches, 256 if args.smoke else 1024, 5)
    except Exception as e:  # the reuse table above is the point; decode is extra
        _log(f"decode rows failed: {type(e).__name__}: {e}")
    for r in result.get("decode", []):
        print(f"decode B={r['batch']:>3} ctx={r['context']}: {r['step_ms']} ms/step, "
              f"{r['tokens_per_s']} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
