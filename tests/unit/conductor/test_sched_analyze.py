"""The reuse analyzer on a tiny trace whose answers are worked out by hand below.

Blocks of 4 tokens. Requests (time ms: blocks, prompt tokens):
  r0 (0):    [1, 2]     8   first use of 1, 2
  r1 (1000): [1, 2]     8   1 at stack distance 0, 2 at distance 1 (1 was used after it)
  r2 (2000): [3, 4, 5]  12  all new
  r3 (3000): [1, 6]     8   1 at distance 3 (3, 4, 5 used since), 6 new
A hit saves the block's tokens except the one prompt token always computed, so r1 and r3 save
4 + 3 and 4 tokens. 36 prompt tokens in all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.conductor.sched.costmodel import CostModel, Decode, Link, Prefill
from mooncake_k8s.conductor.tools import analyze
from mooncake_k8s.conductor.tools.sim.trace import TraceRequest

TRACE = [
    TraceRequest(0.0, 8, 1, (1, 2)),
    TraceRequest(1000.0, 8, 1, (1, 2)),
    TraceRequest(2000.0, 12, 1, (3, 4, 5)),
    TraceRequest(3000.0, 8, 1, (1, 6)),
]
MODEL = CostModel(name="hand", kv_bytes_per_token=1000, prefill=Prefill(0.0, 1.0, 0.0),
                  transfer={"pool": Link(0.0, 1.0)}, decode=Decode(1.0, 0.0, 0.0))


def test_stack_distances() -> None:
    d = analyze.stack_distances(TRACE, 4)
    inf = analyze.INF
    assert d.dist.tolist() == [inf, inf, 0, 1, inf, inf, inf, 3, inf]
    assert d.tokens.tolist() == [4, 3, 4, 3, 4, 4, 3, 4, 3]
    assert sorted(d.gap_ms.tolist()) == [1000.0, 1000.0, 2000.0]
    assert sorted(d.reuse_counts.tolist()) == [0, 0, 0, 0, 1, 2]


def test_curve_tiers_reuse_and_break_even() -> None:
    opts = analyze.Options(block_tokens=4, dram_tokens=4, ssd_tokens=12, model=MODEL,
                           bandwidth_gbps=1.0, ssd_gbps=0.1, prefill_ms_per_token=1.0)
    r = analyze.analyze(TRACE, opts)
    curve = {c["capacity_blocks"]: c["hit_rate"] for c in r["curve"]}
    assert curve[1] == pytest.approx(4 / 36, abs=1e-4)
    assert curve[2] == pytest.approx(7 / 36, abs=1e-4)
    assert curve[6] == pytest.approx(11 / 36, abs=1e-4)
    assert r["ideal_hit_rate"] == pytest.approx(11 / 36, abs=1e-4)
    assert r["tiers"]["dram_hit_rate"] == pytest.approx(4 / 36, abs=1e-4)
    assert r["tiers"]["ssd_hit_rate"] == pytest.approx(7 / 36, abs=1e-4)
    hist = {b["reuses"]: b["blocks"] for b in r["reuse"]["blocks_by_reuse_count"]}
    assert (hist["0"], hist["1"], hist["2-3"]) == (4, 1, 1)
    assert r["trace"]["unique_blocks"] == 6
    t = r["ttft"]
    # Cold: 8, 8, 12, 8 ms. r1: 1 ms compute + 4 tokens from DRAM (0.004) + 3 from SSD
    # (0.03); r3: 4 ms + 4 tokens from SSD (0.04).
    assert t["mean_ms_without_cache"] == pytest.approx(9.0)
    assert t["mean_ms_with_cache"] == pytest.approx((8 + 1.034 + 12 + 4.04) / 4, abs=0.05)
    # Linear prefill: loading pays off above KV bytes / compute per token = 1000 B/ms.
    assert r["break_even_gbps"] == pytest.approx(0.001)
    saving = {s["gbps"]: s["mean_saving_ms"] for s in t["saving_vs_bandwidth"]}
    assert saving[1] > 0


def test_cli_writes_json_and_png(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.arrival_ms, "input_length":
                                         r.input_tokens, "output_length": 1,
                                         "hash_ids": list(r.blocks)}) + "\n" for r in TRACE))
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    res = CliRunner().invoke(main, ["analyze", str(trace), "--json", str(out), "--plot",
                                    str(png), "--dram-tokens", "4", "--ssd-tokens", "12"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["trace"]["block_tokens"] == 4  # inferred from the trace
    assert data["curve"] and data["break_even_gbps"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "break-even bandwidth" in res.output
