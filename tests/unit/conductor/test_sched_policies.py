"""Each policy's decision and each rejection, on hand-built cluster views (pure functions).

The cost model here is made for arithmetic by hand: prefill costs 1 ms per new token, loading
a cached token costs 0.1 ms from local DRAM and 0.5 ms from the pool, a decode step costs
10 ms + 1 ms per sequence + 0.001 ms per context token, and a decode instance holds 10,000
tokens of KV. Blocks are 10 tokens.
"""

from __future__ import annotations

import pytest

from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig, DecodeLedger, judge
from mooncake_k8s.conductor.sched.costmodel import CostModel, Decode, Link, Prefill
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import (
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
)

KV = 1000  # bytes per token: 1 GB/s = 1e6 bytes per ms = 1000 tokens per ms


def model(pool_ms_per_token: float = 0.5) -> CostModel:
    return CostModel(
        name="hand", kv_bytes_per_token=KV, prefill=Prefill(0.0, 1.0, 0.0),
        transfer={"local": Link(0.0, KV / (0.1 * 1e6)),
                  "pool": Link(0.0, KV / (pool_ms_per_token * 1e6))},
        decode=Decode(10.0, 1.0, 0.001, 10_000))


def setup(policy: str, *, admission: AdmissionConfig | None = None,
          pool_ms_per_token: float = 0.5, seed: int = 0) -> tuple[Scheduler, KVIndex, list[int]]:
    ix = KVIndex()
    masks = [ix.mask([f"p{i}"]) for i in range(3)]
    s = Scheduler(SchedulerConfig(policy=policy, block_tokens=10, admission=admission,
                                  seed=seed), model(pool_ms_per_token), ix)
    return s, ix, masks


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def hold(ix: KVIndex, segment: str, ks: list[str]) -> None:
    bit = ix.segment(segment)
    for k in ks:
        ix.add(k, bit)


def decodes(n: int = 2) -> list[DecodeView]:
    return [DecodeView(i) for i in range(n)]


def test_load_balancing_takes_the_shortest_queue() -> None:
    s, ix, masks = setup("load_balancing")
    hold(ix, "p0", keys(9))  # the cache is ignored
    pv = [PrefillView(0, 500.0, masks[0]), PrefillView(1, 20.0, masks[1]),
          PrefillView(2, 30.0, masks[2])]
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d.prefill == 1
    assert d.ttft_ms == pytest.approx(20 + 100)
    assert (d.local_blocks, d.fetch_blocks, d.cached_tokens) == (0, 0, 0)


def test_local_cache_aware_weighs_cache_against_queue() -> None:
    s, ix, masks = setup("local_cache_aware")
    hold(ix, "p0", keys(5))  # 50 tokens cached on p0: 5 ms to load + 50 ms to compute
    pv = [PrefillView(0, 50.0, masks[0]), PrefillView(1, 0.0, masks[1])]
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d.prefill == 1 and d.ttft_ms == pytest.approx(100)  # 50 + 55 > 0 + 100
    pv[0].queue_ms = 40.0
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d.prefill == 0 and d.ttft_ms == pytest.approx(95)
    assert (d.local_blocks, d.cached_tokens, d.fetch_blocks) == (5, 50, 0)


def test_global_cache_aware_fetches_a_remote_prefix_when_cheaper_and_replicates() -> None:
    s, ix, masks = setup("global_cache_aware")
    hold(ix, "p0", keys(8))  # the prefix lives on a busy instance
    pv = [PrefillView(0, 1000.0, masks[0]), PrefillView(1, 0.0, masks[1])]
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    # p1: fetch 80 tokens over the pool (40 ms) + compute 20 = 60 < recomputing 100.
    assert d.prefill == 1
    assert (d.local_blocks, d.fetch_blocks, d.cached_tokens) == (0, 8, 80)
    assert d.ttft_ms == pytest.approx(60)
    assert d.replicate
    # local-cache-aware on the same state recomputes on p1.
    s2, ix2, _ = setup("local_cache_aware")
    hold(ix2, "p0", keys(8))
    d2 = s2.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d2.prefill == 1 and d2.fetch_blocks == 0 and d2.ttft_ms == pytest.approx(100)


def test_global_cache_aware_recomputes_when_the_pool_link_is_too_slow() -> None:
    s, ix, masks = setup("global_cache_aware", pool_ms_per_token=2.0)
    hold(ix, "p0", keys(8))
    pv = [PrefillView(0, 1000.0, masks[0]), PrefillView(1, 0.0, masks[1])]
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d.prefill == 1 and d.fetch_blocks == 0 and not d.replicate
    assert d.ttft_ms == pytest.approx(100)  # 160 + 20 to fetch would be slower


def test_global_prefers_the_local_holder_when_it_is_not_busy() -> None:
    s, ix, masks = setup("global_cache_aware")
    hold(ix, "p0", keys(8))
    pv = [PrefillView(0, 10.0, masks[0]), PrefillView(1, 0.0, masks[1])]
    d = s.decide(Demand(keys(10), 100, 10), pv, decodes(), 0.0)
    assert d.prefill == 0 and d.local_blocks == 8 and d.fetch_blocks == 0
    assert d.ttft_ms == pytest.approx(10 + 8 + 20)


def test_one_token_is_always_computed() -> None:
    s, ix, masks = setup("local_cache_aware")
    hold(ix, "p0", keys(10))
    d = s.decide(Demand(keys(10), 100, 10), [PrefillView(0, 0.0, masks[0])], decodes(), 0.0)
    assert d.cached_tokens == 99
    assert d.ttft_ms == pytest.approx(9.9 + 1)


def test_round_robin_cycles_and_random_is_seeded() -> None:
    s, _, masks = setup("round_robin")
    pv = [PrefillView(i, 0.0, masks[i]) for i in range(3)]
    picks = [s.decide(Demand([], 10, 2), pv, decodes(2), 0.0) for _ in range(6)]
    assert [p.prefill for p in picks] == [0, 1, 2, 0, 1, 2]
    assert [p.decode for p in picks] == [0, 1, 0, 1, 0, 1]

    def draws(seed: int) -> list[int]:
        s, _, _ = setup("random", seed=seed)
        return [s.decide(Demand([], 10, 2), pv, decodes(2), 0.0).prefill for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert set(draws(1)) == {0, 1, 2}


def test_decode_goes_to_the_least_loaded_instance_with_room() -> None:
    s, _, masks = setup("load_balancing")
    pv = [PrefillView(0, 0.0, masks[0])]
    dv = [DecodeView(0, running=5), DecodeView(1, running=1, kv_used_tokens=9_950),
          DecodeView(2, running=2)]
    d = s.decide(Demand([], 100, 10), pv, dv, 0.0)
    assert d.decode == 2  # 1 is lighter but has no room for 110 more tokens
    # The ledger now counts that request on 2: the next one prefers 0 only if lighter.
    assert s.ledger.seqs[2] == 1 and s.ledger.tokens[2] == 110
    d2 = s.decide(Demand([], 100, 10), pv, dv, 0.0)
    assert d2.decode == 2  # 3 sequences on 2 (2 running + 1 routed) < 5 on 0


def test_predicted_tbt_counts_the_requests_already_on_their_way() -> None:
    s, _, masks = setup("load_balancing")
    pv = [PrefillView(0, 0.0, masks[0])]
    dv = [DecodeView(0)]
    first = s.decide(Demand([], 100, 50), pv, dv, 0.0)
    assert first.tbt_ms == pytest.approx(10 + 1 + 0.15)
    second = s.decide(Demand([], 100, 50), pv, dv, 0.0)
    assert second.tbt_ms == pytest.approx(10 + 2 + 0.3)
    # Long after both are predicted to finish, the ledger has forgotten them.
    later = s.decide(Demand([], 100, 50), pv, dv, 1e9)
    assert later.tbt_ms == pytest.approx(10 + 1 + 0.15)


SLOS = AdmissionConfig(SLO(ttft_ms=200.0, tbt_ms=12.0))


def test_early_rejection_on_predicted_ttft_with_retry_after() -> None:
    s, _, masks = setup("load_balancing", admission=SLOS)
    pv = [PrefillView(0, 2_500.0, masks[0])]
    d = s.decide(Demand([], 100, 10), pv, decodes(1), 0.0)
    assert not d.admitted
    assert d.verdict.reason == "ttft"
    assert d.verdict.retry_after_s == 3  # 2600 - 200 ms over: come back in ~2.4 s
    assert d.verdict.headroom_ms == pytest.approx(200 - 2600)
    assert s.ledger.seqs == [] or s.ledger.seqs[0] == 0  # nothing recorded


def test_batch_traffic_is_shed_before_interactive() -> None:
    s, _, masks = setup("load_balancing", admission=SLOS)
    pv = [PrefillView(0, 50.0, masks[0])]  # predicted TTFT 150 of a 200 ms SLO
    batch = s.decide(Demand([], 100, 10, "batch"), pv, decodes(1), 0.0)
    inter = s.decide(Demand([], 100, 10, "interactive"), pv, decodes(1), 0.0)
    assert not batch.admitted and batch.verdict.reason == "ttft"
    assert inter.admitted


def test_early_rejection_on_predicted_tbt_and_on_kv_room() -> None:
    s, _, masks = setup("load_balancing", admission=SLOS)
    pv = [PrefillView(0, 0.0, masks[0])]
    d = s.decide(Demand([], 100, 10), pv, [DecodeView(0, running=3)], 0.0)
    assert not d.admitted and d.verdict.reason == "tbt"  # 10 + 4 + 0.11 > 12
    full = s.decide(Demand([], 100, 10), pv, [DecodeView(0, kv_used_tokens=9_990)], 0.0)
    assert not full.admitted and full.verdict.reason == "kv"


def test_judge_without_objectives_admits_everything() -> None:
    v = judge(AdmissionConfig(SLO()), "batch", 1e9, 1e9, True)
    assert v.admit


def test_unknown_class_and_bad_config_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown request class"):
        judge(SLOS, "vip", 1.0, 1.0, True)
    with pytest.raises(ValueError):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError):
        AdmissionConfig(SLO(1.0), class_fraction={"batch": 1.5})
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerConfig(policy="fastest")


def test_ledger_predicts_future_load() -> None:
    led = DecodeLedger()
    led.add(0, finish_ms=100.0, tokens=10)
    led.add(0, finish_ms=300.0, tokens=20)
    assert led.at(0, 50.0) == (2, 30)
    assert led.at(0, 200.0) == (1, 20)
    assert led.next_finish(0) == 100.0
    led.expire(150.0)
    assert (led.seqs[0], led.tokens[0]) == (1, 20)
    led.forget(0)
    assert led.at(0, 0.0) == (0, 0)
    led.expire(1e9)  # a forgotten slot's heap entries expire harmlessly
    assert led.seqs[0] == 0


def test_overloaded_is_a_429_with_retry_after() -> None:
    from mooncake_k8s.conductor.http.errors import api_error
    from mooncake_k8s.conductor.sched.admission import Overloaded, Verdict

    e = api_error(Overloaded(Verdict(False, "ttft", 7, -1500.0), "batch"))
    assert e.status == 429 and e.headers == {"Retry-After": "7"}
    body = e.body()["error"]
    assert body["code"] == "slo_ttft" and body["type"] == "rate_limit_error"
    assert "batch request" in body["message"] and "time to first token" in body["message"]


def test_cli_policy_choices_match_the_scheduler() -> None:
    from mooncake_k8s.cli.serving import SCHED_POLICIES
    from mooncake_k8s.conductor.sched.scheduler import POLICIES

    assert SCHED_POLICIES == POLICIES
