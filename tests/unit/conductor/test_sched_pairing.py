"""What `Scheduler.decide` takes as input beyond load and cache: the instances' revisions, the
block size of the prompt's keys, and whether the request may be shed (a resume may not).

These used to be applied around the scheduler by the live router and the pipeline (a decode
instance swapped after the ledger had booked another, a resume's own fallback pair); here each
is one input of the one decision, so the ledger books the pair that is used.
"""

from __future__ import annotations

import pytest

from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig
from mooncake_k8s.conductor.sched.costmodel import CostModel, Decode, Link, Prefill
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import (
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
    paired,
)

KV = 1000  # bytes per token


def model() -> CostModel:
    """1 ms per new prefill token; a cached token loads in 0.1 ms (local), 0.5 ms (pool)."""
    return CostModel(
        name="hand", kv_bytes_per_token=KV, prefill=Prefill(0.0, 1.0, 0.0),
        transfer={"local": Link(0.0, KV / (0.1 * 1e6)), "pool": Link(0.0, KV / (0.5 * 1e6))},
        decode=Decode(10.0, 1.0, 0.001, 10_000))


def keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def hold(ix: KVIndex, segment: str, ks: list[str]) -> None:
    bit = ix.segment(segment)
    for k in ks:
        ix.add(k, bit)


def _sched(policy: str = "load_balancing", *,
           admission: AdmissionConfig | None = None) -> tuple[Scheduler, KVIndex]:
    ix = KVIndex()
    return Scheduler(SchedulerConfig(policy=policy, block_tokens=10, admission=admission),
                     model(), ix), ix


@pytest.mark.parametrize("policy", ["load_balancing", "local_cache_aware",
                                    "global_cache_aware", "round_robin", "random"])
def test_a_prefill_is_paired_only_with_a_decode_of_its_revision(policy: str) -> None:
    s, _ = _sched(policy)
    # The idle prefill runs a revision no decode instance runs yet (a rollout under way).
    pv = [PrefillView(0, 0.0, revision="v2"), PrefillView(1, 500.0, revision="v1")]
    dv = [DecodeView(0, revision="v3"), DecodeView(1, 40, revision="v1")]
    for _ in range(4):
        d = s.decide(Demand(keys(3), 30, 10), pv, dv, 0.0)
        assert (d.prefill, d.decode) == (1, 1)


def test_the_decode_follows_the_prefills_revision_and_the_ledger_books_it() -> None:
    s, _ = _sched()
    pv = [PrefillView(0, 0.0, revision="v2")]
    # The least loaded decode instance is of the other revision.
    dv = [DecodeView(0, 0, revision="v1"), DecodeView(1, 30, revision="v2"),
          DecodeView(2, 20, revision="v2")]
    d = s.decide(Demand(keys(3), 30, 10), pv, dv, 0.0)
    assert d.decode == 2
    assert s.ledger.at(2, 0.0)[0] == 1 and s.ledger.at(0, 0.0)[0] == 0


def test_without_a_revision_in_common_any_pair_is_made() -> None:
    s, _ = _sched()
    pv = [PrefillView(0, 9.0, revision="a"), PrefillView(1, 1.0, revision="b")]
    d = s.decide(Demand(keys(2), 20, 5), pv, [DecodeView(0, revision="c")], 0.0)
    assert (d.prefill, d.decode) == (1, 0) and d.admitted
    assert paired("c", [DecodeView(0, revision="c")])
    assert not paired("a", [DecodeView(0, revision="c")])


def test_a_request_that_may_not_be_shed_gets_the_same_pair_admitted() -> None:
    adm = AdmissionConfig(SLO(ttft_ms=10.0))
    s, _ = _sched(admission=adm)
    pv = [PrefillView(0, 500.0), PrefillView(1, 400.0)]
    dv = [DecodeView(0, 3), DecodeView(1, 1)]
    shed = s.decide(Demand(keys(5), 50, 10), pv, dv, 0.0)
    assert not shed.admitted and shed.verdict.reason == "ttft"
    kept = s.decide(Demand(keys(5), 50, 10), pv, dv, 0.0, shed=False)
    assert kept.admitted
    assert (kept.prefill, kept.decode) == (shed.prefill, shed.decode) == (1, 1)
    assert kept.ttft_ms == shed.ttft_ms
    assert s.ledger.at(1, 0.0)[0] == 1  # booked: the resumed stream is load like any other


def test_the_block_size_is_the_demands_else_the_configured_one() -> None:
    s, ix = _sched("local_cache_aware")
    mask = ix.mask(["p0"])
    hold(ix, "p0", keys(3))
    pv = [PrefillView(0, 0.0, mask)]
    dv = [DecodeView(0)]
    d = s.decide(Demand(keys(3), 100, 4, block_tokens=16), pv, dv, 0.0)
    assert (d.local_blocks, d.cached_tokens) == (3, 48)
    d = s.decide(Demand(keys(3), 100, 4), pv, dv, 0.0)
    assert (d.local_blocks, d.cached_tokens) == (3, 30)  # SchedulerConfig.block_tokens
    d = s.decide(Demand(keys(3), 40, 4, block_tokens=16), pv, dv, 0.0)
    assert d.cached_tokens == 39  # at least one prompt token is computed
