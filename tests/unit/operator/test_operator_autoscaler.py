"""The SLO autoscaler's pure decision, driven with synthetic metric series on a fake clock."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from mooncake_k8s.operator.autoscaler import (
    Decision,
    MetricsSample,
    Policy,
    ScalerState,
    clamp,
    decide,
    ready_counts,
    sample_from_texts,
)

STEP = 15.0


def policy(**kw: float) -> Policy:
    base = dict(prefill_min=1, prefill_max=8, decode_min=1, decode_max=8, ratio_min=0.25,
                ratio_max=4.0, target_prefill_tokens=1000, target_decode_tokens=2000,
                max_rejection_rate=0.01, up_window_s=30.0, down_window_s=120.0,
                ttft_slo_ms=2000.0)
    base.update(kw)
    return Policy(**base)  # type: ignore[arg-type]


def sample(t: float, pq: float = 1000, dq: float | None = 2000, head: float | None = 800,
           rej: float = 0, req: float = 0) -> MetricsSample:
    return MetricsSample(t, pq, dq, head, rej, req)


def run(pol: Policy, start: tuple[int, int], series: Iterable[MetricsSample],
        state: ScalerState | None = None,
        ready: tuple[int, int] | None = None) -> list[tuple[float, Decision]]:
    """Feed samples in order, applying each decision as the next current count."""
    st = state or ScalerState()
    cur, out = start, []
    for s in series:
        d = decide(pol, cur, st, s, ready)
        cur = (d.prefill, d.decode)
        out.append((s.time, d))
    return out


def counts(trace: list[tuple[float, Decision]]) -> list[tuple[int, int]]:
    return [(d.prefill, d.decode) for _, d in trace]


def test_load_at_target_keeps_replicas() -> None:
    pol = policy()
    trace = run(pol, (2, 2), [sample(i * STEP, pq=2000, dq=4000) for i in range(20)])
    assert set(counts(trace)) == {(2, 2)}
    assert trace[-1][1].reason.startswith("steady at 2:2")


def test_noise_within_tolerance_does_not_flap() -> None:
    pol = policy()
    series = [sample(i * STEP, pq=2000 * (1.08 if i % 2 else 0.93), dq=4000) for i in range(20)]
    assert set(counts(run(pol, (2, 2), series))) == {(2, 2)}


def test_sustained_prefill_queue_scales_prefill_after_the_up_window() -> None:
    pol = policy(up_window_s=30)
    calm = [sample(i * STEP, pq=1000, dq=2000) for i in range(4)]
    busy = [sample((4 + i) * STEP, pq=5000, dq=2000) for i in range(5)]
    trace = run(pol, (1, 1), calm + busy)
    got = dict(zip([t for t, _ in trace], counts(trace), strict=True))
    assert got[45.0] == (1, 1)
    # Pressure from t=60 on; the window's smallest recommendation is a calm one until t=90.
    assert got[60.0] == got[75.0] == (1, 1)
    # Then 5 prefill; decode follows to keep prefill/decode <= ratio_max (4).
    assert got[90.0] == got[120.0] == (5, 2)


def test_brief_spike_shorter_than_the_up_window_is_ignored() -> None:
    pol = policy(up_window_s=45)
    calm = [sample(i * STEP, pq=1000, dq=2000) for i in range(4)]
    spike = [sample((4 + i) * STEP, pq=6000, dq=2000) for i in range(2)]
    after = [sample((6 + i) * STEP, pq=1000, dq=2000) for i in range(4)]
    trace = run(pol, (1, 1), calm + spike + after)
    assert set(counts(trace)) == {(1, 1)}


def test_scale_down_waits_for_a_full_down_window() -> None:
    pol = policy(down_window_s=120)
    st = ScalerState()
    busy = [sample(i * STEP, pq=4000, dq=8000) for i in range(10)]
    trace = run(pol, (4, 4), busy, st)
    assert counts(trace)[-1] == (4, 4)
    quiet_start = 10 * STEP
    quiet = [sample(quiet_start + i * STEP, pq=500, dq=1000) for i in range(12)]
    trace = run(pol, (4, 4), quiet, st)
    times_scaled = [t for t, d in trace if (d.prefill, d.decode) != (4, 4)]
    # The busy recommendations (4) stay the window's maximum until they age out.
    assert times_scaled and times_scaled[0] - quiet_start >= pol.down_window_s - 1e-9
    assert counts(trace)[-1] == (1, 1)


def test_fresh_state_never_scales_down() -> None:
    pol = policy(down_window_s=120)
    series = [sample(1000 + i * STEP, pq=0, dq=0) for i in range(8)]  # 105 s < window
    assert set(counts(run(pol, (5, 5), series))) == {(5, 5)}


def test_negative_ttft_headroom_adds_prefill() -> None:
    pol = policy(up_window_s=0)
    trace = run(pol, (2, 2), [sample(0, pq=2000, dq=4000, head=-150)])
    assert counts(trace) == [(3, 2)]
    assert "TTFT headroom -150ms" in trace[0][1].reason


def test_thin_headroom_blocks_prefill_scale_down() -> None:
    pol = policy(down_window_s=0, up_window_s=0)
    thin = run(pol, (4, 2), [sample(0, pq=100, dq=4000, head=50)])
    assert counts(thin) == [(4, 2)]
    roomy = run(pol, (4, 2), [sample(0, pq=100, dq=4000, head=1500)])
    assert counts(roomy) == [(1, 2)]


def test_rejections_scale_both_roles() -> None:
    pol = policy(up_window_s=0)
    series = [sample(0, pq=2000, dq=4000, rej=0, req=1000),
              sample(STEP, pq=2000, dq=4000, rej=50, req=2000)]  # 5% of the last 1000
    trace = run(pol, (2, 2), series)
    assert counts(trace) == [(2, 2), (3, 3)]
    assert "rejecting 5.0%" in trace[-1][1].reason


def test_counter_reset_is_not_a_rejection_burst() -> None:
    pol = policy(up_window_s=0)
    series = [sample(0, pq=2000, dq=4000, rej=500, req=10000),
              sample(STEP, pq=2000, dq=4000, rej=3, req=100)]  # conductor restarted
    assert counts(run(pol, (2, 2), series)) == [(2, 2), (2, 2)]


def test_ratio_bounds_raise_the_other_role() -> None:
    pol = policy(ratio_max=2.0, up_window_s=0)
    trace = run(pol, (1, 1), [sample(0, pq=6000, dq=0)])
    p, d = counts(trace)[0]
    assert (p, d) == (6, 3) and p / d <= 2.0


def test_ratio_bounds_cap_prefill_when_decode_is_at_max() -> None:
    pol = policy(ratio_max=2.0, decode_max=2, up_window_s=0)
    (got,) = counts(run(pol, (1, 1), [sample(0, pq=8000, dq=0)]))
    assert got == (4, 2)


@pytest.mark.parametrize("p", range(0, 12))
@pytest.mark.parametrize("d", range(0, 12))
def test_clamp_always_lands_inside_every_bound(p: int, d: int) -> None:
    pol = policy(prefill_min=2, prefill_max=6, decode_min=1, decode_max=5, ratio_min=0.5,
                 ratio_max=2.0)
    cp, cd = clamp(p, d, pol)
    assert 2 <= cp <= 6 and 1 <= cd <= 5
    assert 0.5 - 1e-9 <= cp / cd <= 2.0 + 1e-9


def test_sample_from_several_conductors() -> None:
    a = """
# TYPE mooncake_conductor_queue_tokens gauge
mooncake_conductor_queue_tokens{role="prefill"} 1200
mooncake_conductor_queue_tokens{role="decode"} 7
# TYPE mooncake_conductor_decode_load_tokens gauge
mooncake_conductor_decode_load_tokens 300
# TYPE mooncake_conductor_predicted_ttft_headroom_ms gauge
mooncake_conductor_predicted_ttft_headroom_ms 400
# TYPE mooncake_conductor_rejections_total counter
mooncake_conductor_rejections_total 3
# TYPE mooncake_conductor_requests_total counter
mooncake_conductor_requests_total{route="chat"} 90
mooncake_conductor_requests_total{route="completions"} 10
"""
    b = a.replace("1200", "1500").replace(" 400", " -20").replace(" 3\n", " 2\n")
    s = sample_from_texts([a, b, "garbage {{{"], now=42.0)
    assert s == MetricsSample(42.0, 1500.0, 300.0, -20.0, 5.0, 200.0)
    assert sample_from_texts(["# nothing here\n", "up 1\n"], now=1.0) is None


def test_an_older_conductor_without_decode_load_leaves_decode_alone() -> None:
    # Its decode queue series counted sequences, not tokens: it must not be read as load.
    text = ('mooncake_conductor_queue_tokens{role="prefill"} 100\n'
            'mooncake_conductor_queue_tokens{role="decode"} 3\n')
    s = sample_from_texts([text], now=0.0)
    assert s is not None and s.decode_load_tokens is None
    pol = policy(up_window_s=0, down_window_s=0)
    assert counts(run(pol, (1, 4), [s])) == [(1, 4)]
    assert "decode load unknown" in run(pol, (1, 4), [s])[0][1].reason


def test_decode_load_scales_decode_alone() -> None:
    pol = policy(up_window_s=0)
    trace = run(pol, (2, 2), [sample(0, pq=2000, dq=9000)])
    assert counts(trace) == [(2, 5)]  # 9000 KV tokens / 2000 per pod


def _sts(ready: int | None) -> dict[str, object]:
    return {"kind": "StatefulSet", "status": {} if ready is None else {"readyReplicas": ready}}


def test_ready_counts_come_from_the_statefulsets() -> None:
    assert ready_counts({"prefill": _sts(2), "decode": _sts(None), "conductor": _sts(1)}) == (2, 0)
    assert ready_counts({"prefill": _sts(2)}) is None  # decode not observed: unknown


def test_starting_pods_stop_the_rejection_step_from_overshooting() -> None:
    """Rejections go on while the added decode pod loads its model (4 intervals here): without
    the ready counts every interval adds one more; with them, one pod is added and the next
    step waits until it is ready."""
    pol = policy(up_window_s=0)
    series = [sample(i * STEP, pq=2000, dq=4000, rej=100 * i, req=1000 * i) for i in range(6)]
    blind = run(pol, (2, 2), series)
    assert [d for _, d in counts(blind)] == [2, 3, 4, 5, 6, 7]
    st, cur, got, reasons = ScalerState(), (2, 2), [], []
    for i, s in enumerate(series):
        ready = (2, 2 if i < 5 else 3)  # the third decode is ready at the last sample
        dec = decide(pol, cur, st, s, ready)
        cur = (dec.prefill, dec.decode)
        got.append(dec.decode)
        reasons.append(dec.reason)
    assert got == [2, 3, 3, 3, 3, 4]
    assert "rejecting 10.0%" in reasons[2] and "1 decode starting" in reasons[2]


def test_starting_pods_count_as_capacity_for_the_load_rule() -> None:
    # 8000 decode tokens = 4 pods at target; 4 desired, 1 ready: the 3 loading cover it.
    pol = policy(up_window_s=0)
    d = decide(pol, (1, 4), ScalerState(), sample(0, pq=1000, dq=8000), ready=(1, 1))
    assert (d.prefill, d.decode) == (1, 4)
    assert "3 decode starting" in d.reason
    # Load beyond what is coming still scales: 12000 tokens need 6.
    d = decide(pol, (1, 4), ScalerState(), sample(0, pq=1000, dq=12000), ready=(1, 1))
    assert d.decode == 6


def test_starting_prefill_pods_hold_the_headroom_step() -> None:
    pol = policy(up_window_s=0)
    assert counts(run(pol, (2, 2), [sample(0, pq=2000, dq=4000, head=-150)], ready=(1, 2))) == [
        (2, 2)]
    assert counts(run(pol, (2, 2), [sample(0, pq=2000, dq=4000, head=-150)], ready=(2, 2))) == [
        (3, 2)]
