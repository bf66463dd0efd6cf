"""The trace replay: deterministic, cache-aware policies reuse more, early rejection sheds load,
and the CLI writes the documented JSON."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.conductor.sched import costmodel
from mooncake_k8s.conductor.sched.scheduler import POLICIES
from mooncake_k8s.conductor.tools.sim import replay, trace
from mooncake_k8s.conductor.tools.sim.cluster import tbt_of
from mooncake_k8s.conductor.tools.sim.trace import TraceRequest


def conversations(n: int = 400, seed: int = 0, gap_ms: float = 400.0) -> list[TraceRequest]:
    """Multi-turn conversations over a shared system prompt: each turn extends its
    conversation's previous prompt (512-token blocks, like the published traces)."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1000
    out = []
    t = 0.0
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            convs.append([0, 1])  # the shared system prompt
        c = rng.choice(convs)
        for _ in range(rng.randint(2, 6)):
            c.append(next_id)
            next_id += 1
        t += rng.expovariate(1.0 / gap_ms)
        out.append(TraceRequest(t, len(c) * 512 - rng.randint(0, 400), rng.randint(20, 300),
                                tuple(c)))
    return out


SETUP = replay.ReplaySetup(prefill_instances=4, decode_instances=4, local_cache_tokens=200_000,
                           ttft_slo_ms=10_000, tbt_slo_ms=100)


@pytest.fixture(scope="module")
def model() -> costmodel.CostModel:
    return costmodel.load()


def test_replay_is_deterministic(model: costmodel.CostModel) -> None:
    reqs = conversations()
    a = replay.run_all(reqs, SETUP, model, ("random", "global_cache_aware"), (False, True))
    b = replay.run_all(reqs, SETUP, model, ("random", "global_cache_aware"), (False, True))
    strip = [{k: v for k, v in r.items() if k != "sim_seconds"} for r in a["rows"]]
    assert strip == [{k: v for k, v in r.items() if k != "sim_seconds"} for r in b["rows"]]
    other = replay.run_all(reqs, replace_seed(SETUP, 7), model, ("random",), (False,))
    assert other["rows"][0]["ttft_mean_ms"] != a["rows"][0]["ttft_mean_ms"]


def replace_seed(s: replay.ReplaySetup, seed: int) -> replay.ReplaySetup:
    from dataclasses import replace

    return replace(s, seed=seed)


def test_cache_aware_policies_reuse_more_and_answer_sooner(model: costmodel.CostModel) -> None:
    reqs = conversations(600, gap_ms=250.0)
    rows = {r["policy"]: r for r in replay.run_all(reqs, SETUP, model, POLICIES,
                                                    (False,))["rows"]}
    assert rows["global_cache_aware"]["hit_rate"] > rows["local_cache_aware"]["hit_rate"]
    assert rows["local_cache_aware"]["hit_rate"] > rows["load_balancing"]["hit_rate"]
    assert (rows["global_cache_aware"]["ttft_mean_ms"]
            < rows["load_balancing"]["ttft_mean_ms"] < rows["random"]["ttft_mean_ms"])
    assert rows["global_cache_aware"]["replicated_blocks"] > 0
    assert rows["local_cache_aware"]["fetched_blocks"] == 0
    for r in rows.values():
        assert r["rejected"] == 0 and 0 <= r["effective_capacity"] <= 1


def test_early_rejection_protects_admitted_requests_under_overload(
        model: costmodel.CostModel) -> None:
    reqs = conversations(500, gap_ms=60.0)  # far more prefill work than 4 instances do
    out = replay.run_all(reqs, SETUP, model, ("load_balancing",), (False, True))
    plain, er = out["rows"]
    assert plain["rejected"] == 0 and er["rejected"] > 0
    assert er["ttft_p99_ms"] <= SETUP.ttft_slo_ms < plain["ttft_p99_ms"]
    assert er["effective_capacity"] > plain["effective_capacity"]


def test_tbt_is_the_mean_of_the_slowest_tenth() -> None:
    import numpy as np

    durs = np.array([10.0] * 19 + [100.0])
    ends = np.cumsum(durs)
    # first interval: end of step 0 (10) - token 1 at 5 = 5; then 19 steps: 18 x 10, 1 x 100.
    assert tbt_of(durs, ends, 0, 20, 5.0) == pytest.approx((100 + 10) / 2)


def _write(path: Path, reqs: list[TraceRequest]) -> None:
    path.write_text("".join(json.dumps({"timestamp": r.arrival_ms, "input_length":
                                        r.input_tokens, "output_length": r.output_tokens,
                                        "hash_ids": list(r.blocks)}) + "\n" for r in reqs))


def test_cli_replay_writes_rows_for_every_policy(tmp_path: Path) -> None:
    t = tmp_path / "trace.jsonl"
    _write(t, conversations(150))
    out = tmp_path / "out.json"
    res = CliRunner().invoke(main, ["replay", str(t), "--json", str(out), "--prefill", "2",
                                    "--decode", "2", "--ttft-slo-ms", "5000"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["setup"]["prefill_instances"] == 2 and data["setup"]["block_tokens"] == 512
    assert data["setup"]["ttft_slo_ms"] == 5000 and data["setup"]["requests"] == 150
    keys = {"policy", "early_rejection", "effective_capacity", "ttft_mean_ms", "ttft_p90_ms",
            "ttft_p99_ms", "hit_rate", "rejected"}
    assert all(keys <= set(r) for r in data["rows"])
    assert {(r["policy"], r["early_rejection"]) for r in data["rows"]} == {
        (p, e) for p in POLICIES for e in (False, True)}
    assert {c["check"] for c in data["checks"]} == {"ttft_order", "capacity_ratio"}


def test_cli_replay_rejects_a_bad_trace_line(tmp_path: Path) -> None:
    t = tmp_path / "bad.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": "soon"}\n')
    res = CliRunner().invoke(main, ["replay", str(t)])
    assert res.exit_code == 2
    assert "bad.jsonl:2" in res.output


def test_trace_loader_sorts_and_rebases_times(tmp_path: Path) -> None:
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 500, "input_length": 5, "output_length": 1, "hash_ids": [2]}\n'
                 '\n{"timestamp": 100, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n')
    reqs = trace.load(t)
    assert [(r.arrival_ms, r.blocks) for r in reqs] == [(0.0, (1,)), (400.0, (2,))]
    with pytest.raises(trace.TraceError, match="no requests"):
        (tmp_path / "empty.jsonl").write_text("\n")
        trace.load(tmp_path / "empty.jsonl")
