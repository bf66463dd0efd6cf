"""Decisions across hosts: what a link costs decides fetch or recompute, and the instances whose
host holds a prompt's prefix are preferred (prefill always by cost, decode load permitting).

The numbers are the shipped CPU profile's (SmolLM2-135M on this machine's CPU: 46,080 KV bytes
per token, about 2.5 ms of prefill per token), with the pool link (between hosts) set to
100 Mbit/s or 10 Gbit/s, as `mooncake calibrate --links-only` would measure a test bed's.
Masks are per host, as the router builds them: an instance's mask is every segment on its host.
"""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, CostModel, Link, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import (
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
)

BT = 16
TAIL = 64  # new tokens of the prompt after its cached prefix
MBIT100 = 100e6 / 8 / 1e9  # GB/s
GBIT10 = 10e9 / 8 / 1e9


def cpu(pool_gbps: float) -> CostModel:
    m = load(BUILTIN_CPU_PROFILE)
    return dataclasses.replace(m, transfer={"local": m.transfer["local"],
                                            "pool": Link(0.2, pool_gbps)})


def keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def hold(ix: KVIndex, segment: str, n: int) -> None:
    bit = ix.segment(segment)
    for k in keys(n):
        ix.add(k, bit)


def scheduler(model: CostModel, policy: str = "global_cache_aware",
              admission: AdmissionConfig | None = None) -> tuple[Scheduler, KVIndex]:
    ix = KVIndex()
    return Scheduler(SchedulerConfig(policy=policy, block_tokens=BT, admission=admission),
                     model, ix), ix


@pytest.mark.parametrize("gbps", [MBIT100, GBIT10], ids=["100mbit", "10gbit"])
@pytest.mark.parametrize("prefix", [1024, 3072])
def test_a_prefix_on_another_host_is_fetched_only_when_that_is_faster(
        gbps: float, prefix: int) -> None:
    model = cpu(gbps)
    s, ix = scheduler(model)
    hold(ix, "seg-b", prefix // BT)  # host B: the prefix's only copy
    prompt = prefix + TAIL
    pv = [PrefillView(0, 0.0, ix.mask(["seg-a", "pf-a"]))]  # the prefill is on host A
    d = s.decide(Demand(keys(prompt // BT), prompt, 8), pv, [DecodeView(0)], 0.0)
    # Over the wire, but never faster than loading it here (plus the network's latency).
    wire, here = model.transfer_ms("pool", prefix), model.transfer_ms("local", prefix)
    load_ms = wire if wire > here else here + model.link("pool").latency_ms
    fetch_ms = load_ms + model.prefill_ms(TAIL, prefix)
    compute_ms = model.prefill_ms(prompt)
    assert (d.fetch_blocks > 0) == (fetch_ms < compute_ms)
    assert d.ttft_ms == pytest.approx(min(fetch_ms, compute_ms))
    assert d.replicate == (d.fetch_blocks > 0)  # what is fetched is kept on host A
    # What the model says, for the record: at 100 Mbit/s a 1K prefix (47 MB, 3.8 s on the
    # wire) is recomputed (3.2 s) and a 3K one (142 MB, 11.3 s) is fetched rather than
    # recomputed (12.6 s, attention grows with the square); at 10 Gbit/s both are fetched
    # (the wire is then faster than the CPU's 0.91 GB/s load, which bounds the fetch).
    assert d.fetch_blocks == (0 if (gbps, prefix) == (MBIT100, 1024) else prefix // BT)


@pytest.mark.parametrize("gbps", [MBIT100, GBIT10], ids=["100mbit", "10gbit"])
def test_the_prefill_whose_host_holds_the_prefix_is_preferred(gbps: float) -> None:
    s, ix = scheduler(cpu(gbps))
    hold(ix, "dec-b", 3072 // BT)  # in the decode's segment on host B
    prompt = 3072 + TAIL
    # p0 on host A, p1 on host B (its own segment holds nothing, its host does).
    pv = [PrefillView(0, 0.0, ix.mask(["pf-a", "dec-a"])),
          PrefillView(1, 0.0, ix.mask(["pf-b", "dec-b"]))]
    d = s.decide(Demand(keys(prompt // BT), prompt, 8), pv, [DecodeView(0)], 0.0)
    assert d.prefill == 1 and d.local_blocks == 3072 // BT and d.fetch_blocks == 0
    assert not d.replicate
    # A busy holder still wins while its queue costs less than moving the prefix; a queue
    # longer than that sends the request to host A, which fetches or recomputes.
    m = s.model
    move = m.transfer_ms("pool", 3072) - m.transfer_ms("local", 3072)
    pv[1].queue_ms = move / 2
    assert s.decide(Demand(keys(prompt // BT), prompt, 8), pv, [DecodeView(0)], 0.0).prefill == 1
    pv[1].queue_ms = m.prefill_ms(prompt) + 1.0
    assert s.decide(Demand(keys(prompt // BT), prompt, 8), pv, [DecodeView(0)], 0.0).prefill == 0


def _decodes(ix: KVIndex, running: int = 0, kv_used_tokens: int = 0,
             kv_capacity_tokens: int = 0) -> list[DecodeView]:
    """d0 on host A (listed first: the load-based tie-break's pick), d1 on host B with the
    load given."""
    return [DecodeView(0, local_mask=ix.mask(["dec-a"])),
            DecodeView(1, running, kv_used_tokens, kv_capacity_tokens,
                       local_mask=ix.mask(["dec-b"]))]


@pytest.mark.parametrize("gbps", [MBIT100, GBIT10], ids=["100mbit", "10gbit"])
def test_decode_whose_host_holds_the_prefix_wins_when_loads_are_equal(gbps: float) -> None:
    s, ix = scheduler(cpu(gbps))
    hold(ix, "dec-b", 1024 // BT)
    prompt = 1024 + TAIL
    pv = [PrefillView(0, 0.0, ix.mask(["pf-b", "dec-b"]))]
    d = s.decide(Demand(keys(prompt // BT), prompt, 32), pv, _decodes(ix), 0.0)
    assert d.decode == 1
    # A prompt with nothing reused has no locality to win: the tie goes to the first.
    s2, ix2 = scheduler(cpu(gbps))
    d3 = s2.decide(Demand([], prompt, 32), [PrefillView(0, 0.0, ix2.mask(["pf-b"]))],
                   _decodes(ix2), 0.0)
    assert d3.decode == 0


def test_an_overloaded_holder_loses_to_the_load_based_choice() -> None:
    s, ix = scheduler(cpu(GBIT10))
    hold(ix, "dec-b", 1024 // BT)
    prompt = 1024 + TAIL
    pv = [PrefillView(0, 0.0, ix.mask(["pf-b", "dec-b"]))]
    # 20 sequences on the holder: 31 steps at +160 ms each dwarf moving 47 MB at 10 Gbit/s.
    d = s.decide(Demand(keys(prompt // BT), prompt, 32), pv, _decodes(ix, running=20), 0.0)
    assert d.decode == 0
    # Full (no room for the request's KV): never chosen over an instance with room.
    s2, ix2 = scheduler(cpu(MBIT100))
    hold(ix2, "dec-b", 1024 // BT)
    pv2 = [PrefillView(0, 0.0, ix2.mask(["pf-b", "dec-b"]))]
    full = _decodes(ix2, kv_used_tokens=1000, kv_capacity_tokens=1100)
    assert s2.decide(Demand(keys(prompt // BT), prompt, 32), pv2, full, 0.0).decode == 0


def test_a_holder_over_the_tbt_objective_is_not_preferred() -> None:
    m = cpu(MBIT100)
    tbt_idle = m.step_ms(1, 1024 + TAIL + 8)
    # An objective the idle instance meets and the holder (2 more sequences) does not.
    adm = AdmissionConfig(SLO(tbt_ms=tbt_idle + m.decode.per_seq_ms))
    s, ix = scheduler(m, admission=adm)
    hold(ix, "dec-b", 1024 // BT)
    prompt = 1024 + TAIL
    pv = [PrefillView(0, 0.0, ix.mask(["pf-b", "dec-b"]))]
    # At 100 Mbit/s moving the prefix (3.8 s) costs more than 2 sequences' worth of slower
    # steps, so only the objective keeps the request off the holder.
    d = s.decide(Demand(keys(prompt // BT), prompt, 8), pv, _decodes(ix, running=2), 0.0)
    assert d.decode == 0 and d.admitted
    s2, ix2 = scheduler(m)  # no objective: the cheaper holder
    hold(ix2, "dec-b", 1024 // BT)
    pv2 = [PrefillView(0, 0.0, ix2.mask(["pf-b", "dec-b"]))]
    assert s2.decide(Demand(keys(prompt // BT), prompt, 8), pv2, _decodes(ix2, running=2),
                     0.0).decode == 1


def test_load_balancing_ignores_where_the_prefix_is() -> None:
    s, ix = scheduler(cpu(GBIT10), policy="load_balancing")
    hold(ix, "dec-b", 1024 // BT)
    prompt = 1024 + TAIL
    pv = [PrefillView(0, 0.0, ix.mask(["pf-b", "dec-b"]))]
    assert s.decide(Demand(keys(prompt // BT), prompt, 32), pv, _decodes(ix), 0.0).decode == 0
