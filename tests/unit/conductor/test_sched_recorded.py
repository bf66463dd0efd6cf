"""The scheduler's decisions, replayed against a recording: a faster `decide` must decide alike.

`scenario()` drives every policy, with and without early rejection, through a seeded cluster:
an index whose holders are random (prefixes held on one to several instances, gaps, SSD
copies, instances with two segments or none), queues drawn from a few values so that ties
happen, decode instances that fill up, empty and unknown prompts, prompts shorter than a block
and prompts whose every token is cached. Each decision is flattened to JSON, whole (indices,
block counts, predicted times bit for bit, verdict, the index's match); the recording in
`sched_decisions.json` was made by the scheduler as it was before it was made fast.

Regenerate (only when a decision is meant to change, and say why in the commit):

    python tests/unit/conductor/test_sched_recorded.py
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig, DecodeLedger
from mooncake_k8s.conductor.sched.costmodel import CostModel, Decode, Link, Prefill
from mooncake_k8s.conductor.sched.kvindex import SSD, KVIndex
from mooncake_k8s.conductor.sched.policies import least_loaded
from mooncake_k8s.conductor.sched.scheduler import (
    POLICIES,
    Decision,
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
)

RECORDING = Path(__file__).with_name("sched_decisions.json")


def _hand_model() -> CostModel:
    kv = 1000
    return CostModel(
        name="hand", kv_bytes_per_token=kv, prefill=Prefill(0.0, 1.0, 0.0),
        transfer={"local": Link(0.0, kv / (0.1 * 1e6)), "pool": Link(0.0, kv / (0.5 * 1e6))},
        decode=Decode(10.0, 1.0, 0.001, 10_000))


def _paper_model() -> CostModel:
    # llama3-70b-a800x8 as shipped, with latencies added so that every term matters.
    return CostModel(
        name="paper", kv_bytes_per_token=327680,
        prefill=Prefill(1.5, 0.094640706, 4.2010256e-06),
        transfer={"local": Link(0.05, 128.0), "pool": Link(0.4, 87.0), "ssd": Link(2.0, 12.0),
                  "decode": Link(0.4, 87.0)},
        decode=Decode(12.366, 0.11314, 2.8698e-05, 1456528))


def _flat(d: Decision) -> list[Any]:
    v = d.verdict
    m = d.match
    return [d.prefill, d.decode, d.local_blocks, d.fetch_blocks, d.cached_tokens, d.ttft_ms,
            d.tbt_ms, d.replicate, v.admit, v.reason, v.retry_after_s, v.headroom_ms,
            m.global_blocks, m.dram_blocks, list(m.local_blocks)]


def _case(policy: str, admitting: bool, paper: bool, seed: int, *, instances: int,
          blocks_per_prompt: int, steps: int, empty_index: bool = False) -> list[list[Any]]:
    rng = random.Random(seed)
    bt = 16
    model = _paper_model() if paper else _hand_model()
    adm = None
    if admitting:
        adm = AdmissionConfig(SLO(ttft_ms=rng.choice([200.0, 800.0, 3000.0]),
                                  tbt_ms=rng.choice([15.0, 30.0, None])))
    ix = KVIndex()
    sched = Scheduler(SchedulerConfig(policy=policy, block_tokens=bt, admission=adm,
                                      replicate_min_blocks=rng.choice([1, 2]), seed=seed),
                      model, ix)
    # Segments: instance i owns "p{i}" and sometimes a second one; some own none at all.
    masks: list[int] = []
    segs: list[list[int]] = []
    for i in range(instances):
        names = [] if rng.random() < 0.1 else [f"p{i}"] + ([f"p{i}b"] if rng.random() < 0.3
                                                          else [])
        masks.append(ix.mask(names))
        segs.append([ix.segment(n) for n in names])
    pool = [ix.segment("pool-0"), ix.segment("pool-1")]
    ssd = ix.segment("pool-0-ssd", "node-0", SSD)
    chains: list[list[str]] = []
    for c in range(12):
        chain = [f"s{seed}c{c}b{b}" for b in range(blocks_per_prompt)]
        chains.append(chain)
        if empty_index:
            continue
        holders = rng.sample(range(instances), k=rng.randint(1, min(instances, 4)))
        for h in holders:
            if not segs[h]:
                continue
            upto = rng.randint(0, blocks_per_prompt)
            for k in chain[:upto]:
                ix.add(k, rng.choice(segs[h]))
                if rng.random() < 0.05:  # a gap: this block is missing on h
                    ix.discard(k, segs[h][0])
        pupto = rng.randint(0, blocks_per_prompt)
        for k in chain[:pupto]:
            r = rng.random()
            if r < 0.6:
                ix.add(k, rng.choice(pool))
            elif r < 0.9:
                ix.add(k, ssd)
    queue_values = [0.0, 5.0, 5.0, 40.0, 120.0, 900.0]
    out: list[list[Any]] = []
    now = 0.0
    for _ in range(steps):
        # Instances come and go: a random subset, in a random order.
        pick = rng.sample(range(instances), k=rng.randint(1, instances))
        prefills = [PrefillView(i, rng.choice(queue_values) if rng.random() < 0.7
                                else rng.uniform(0, 1500), masks[i]) for i in pick]
        dslots = rng.sample(range(instances + 3), k=rng.randint(1, instances))
        decodes = []
        for s in dslots:
            cap = rng.choice([0, 0, 5_000, 20_000, 1_000_000])
            decodes.append(DecodeView(s, rng.choice([0, 0, 3, 40]),
                                      rng.choice([0, 0, cap // 2, cap]) if cap else 0, cap))
        kind = rng.random()
        if kind < 0.1:
            keys: list[str] = []
        elif kind < 0.2:
            keys = [f"new{rng.getrandbits(32)}-{b}" for b in range(rng.randint(1, 8))]
        else:
            chain = rng.choice(chains)
            keys = chain[: rng.randint(1, len(chain))]
            if rng.random() < 0.3:
                keys = keys + [f"tail{rng.getrandbits(32)}-{b}" for b in range(3)]
        extra = rng.choice([0, 0, 1, bt - 1])
        prompt = max(1, len(keys) * bt + extra)
        demand = Demand(keys, prompt, rng.choice([1, 16, 256, 4000]),
                        rng.choice(["interactive", "batch"]))
        out.append(_flat(sched.decide(demand, prefills, decodes, now)))
        # The index moves between decisions, as the store's events arrive.
        for _ in range(rng.randint(0, 3)):
            if empty_index:
                break
            k = rng.choice(rng.choice(chains))
            h = rng.randrange(instances)
            if segs[h]:
                if rng.random() < 0.5:
                    ix.add(k, segs[h][0])
                else:
                    ix.discard(k, segs[h][0])
        now += rng.choice([0.0, 1.0, 50.0, 400.0])
    return out


def scenario() -> dict[str, list[list[Any]]]:
    cases: dict[str, list[list[Any]]] = {}
    n = 0
    for policy in POLICIES:
        for admitting in (False, True):
            for paper in (False, True):
                n += 1
                name = f"{policy}/{'slo' if admitting else 'open'}/{'paper' if paper else 'hand'}"
                cases[name] = _case(policy, admitting, paper, n, instances=6,
                                    blocks_per_prompt=10, steps=25)
    cases["global/wide"] = _case("global_cache_aware", True, True, 101, instances=70,
                                 blocks_per_prompt=40, steps=40)
    cases["local/wide"] = _case("local_cache_aware", False, False, 102, instances=70,
                                blocks_per_prompt=40, steps=20)
    cases["global/empty-index"] = _case("global_cache_aware", True, False, 103, instances=5,
                                        blocks_per_prompt=8, steps=10, empty_index=True)
    cases["global/one-instance"] = _case("global_cache_aware", True, True, 104, instances=1,
                                         blocks_per_prompt=8, steps=15)
    return cases


def test_decisions_match_the_recording() -> None:
    recorded = json.loads(RECORDING.read_text())
    got = json.loads(json.dumps(scenario()))
    assert list(got) == list(recorded)
    for name, decisions in recorded.items():
        assert len(got[name]) == len(decisions), name
        for i, (g, r) in enumerate(zip(got[name], decisions, strict=True)):
            assert g == r, f"{name} decision {i}: got {g}, recorded {r}"


def test_the_recording_covers_the_edges() -> None:
    recorded = json.loads(RECORDING.read_text())
    flat = [d for ds in recorded.values() for d in ds]
    assert {d[9] for d in flat} >= {"", "ttft", "tbt", "kv"}  # admitted and every rejection
    assert any(d[3] > 0 for d in flat)  # a fetch from the pool
    assert any(d[12] == 0 for d in flat)  # nothing cached anywhere
    assert any(d[13] < d[12] for d in flat)  # part of the prefix only on SSD
    assert any(0 < d[2] < d[12] for d in flat)  # a local prefix shorter than the pool's


def _full_scan(decodes: list[DecodeView], ledger: DecodeLedger, ps: float, pc: float,
               dcap: int, need: int) -> int:
    """The decode ranking as it was: every instance, exactly, in order."""
    best, di = math.inf, 0
    for i, d in enumerate(decodes):
        s = max(ledger.seqs[d.slot], d.running)
        t = max(ledger.tokens[d.slot], d.kv_used_tokens)
        cap = d.kv_capacity_tokens or dcap
        v = ps * s + pc * t + (1e18 if cap and t + need > cap else 0.0)
        if v < best:
            best, di = v, i
    return di


def test_pruned_decode_ranking_matches_a_full_scan() -> None:
    rng = random.Random(5)
    for case in range(3000):
        ledger = DecodeLedger()
        ps, pc = rng.choice([(0.11314, 2.8698e-05), (1.0, 0.001), (0.0, 0.5), (2.0, 0.0)])
        ledger.weigh(ps, pc)
        n = rng.randint(1, 12)
        ledger.ensure(n + 2)
        for _ in range(rng.randint(0, 30)):  # few distinct sizes: ties are common
            ledger.add(rng.randrange(n + 2), rng.uniform(0, 100), rng.choice([100, 100, 900]))
        if rng.random() < 0.3:
            ledger.expire(rng.uniform(0, 100))
        dcap = rng.choice([0, 2_000, 100_000])
        decodes = [DecodeView(s, rng.choice([0, 0, 0, 2, 9]), rng.choice([0, 0, 500, 3000]),
                              rng.choice([0, 0, 1_500, 50_000]))
                   for s in rng.sample(range(n + 2), k=n)]
        need = rng.choice([10, 400, 1_200])
        want = _full_scan(decodes, ledger, ps, pc, dcap, need)
        assert least_loaded(decodes, ledger, dcap, need) == want, case


if __name__ == "__main__":
    RECORDING.write_text(json.dumps(scenario(), separators=(",", ":")) + "\n")
    print(f"wrote {RECORDING}")
