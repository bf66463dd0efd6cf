"""The SLO autoscaler's decision: a pure function of a policy, a metric sample and history.

Each interval the operator scrapes every Conductor pod, builds one `MetricsSample`, and calls
`decide` with each role's desired and ready replica counts. The policy, for users, is in
docs/autoscaling.md. The decision runs in three steps:

1. *Recommend* from the latest sample alone: enough prefill pods to keep queued prompt tokens per
   pod at the target, enough decode pods to keep the decode load (KV tokens held plus context
   tokens waiting, `mooncake_conductor_decode_load_tokens`) per pod at its target; one more
   prefill when the predicted TTFT headroom is negative, one more of each when the rejection
   rate is above its bound. A usage within 10% of the target keeps the current count (no
   flapping on noise), and prefill never shrinks while TTFT headroom is under 10% of the SLO.
   Pods not ready yet are capacity on its way: the desired count (not the ready one) is what the
   load is divided against, and a role with pods still starting gets no "one more" step, which
   would otherwise add a pod every interval until the first new one has loaded its model.
2. *Stabilize* per role like the HPA: scale up to the smallest recommendation of the up window
   (pressure must persist), down to the largest of the down window, and only once the history
   covers the whole down window (an operator restart never triggers a scale-down).
3. *Bound*: clamp to each role's min/max, then move the pair into the prefill:decode ratio
   bounds, raising the smaller side when it can (never dropping capacity to satisfy a ratio).
4. *One drain at a time*: a role scaled down less than its pods' grace period ago (drain
   timeout plus margin, `roles.<role>.drainTimeoutSeconds`) is not scaled down again, so the
   pods that take over a stopping decode's streams are not stopping themselves.

Multiple Conductor pods: queues and headroom describe shared instances, so the worst value
(max queue, min headroom) is used; counters are summed. A Conductor that exports no decode load
(an older version, during an upgrade) leaves decode where it is rather than read as idle.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.operator import admission, metrics, schema_gateway

TOLERANCE = 0.1
ROLES = ("prefill", "decode")
_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    prefill_min: int
    prefill_max: int
    decode_min: int
    decode_max: int
    ratio_min: float
    ratio_max: float
    target_prefill_tokens: int
    target_decode_tokens: int
    max_rejection_rate: float
    up_window_s: float
    down_window_s: float
    ttft_slo_ms: float
    prefill_step: int = 1
    """Prefill pods per pipeline group: prefill moves in whole groups (its bounds are
    multiples of it, which the CRD enforces)."""
    prefill_grace_s: float = 0.0
    decode_grace_s: float = 0.0
    """How long a stopped pod of the role may take to drain (its terminationGracePeriodSeconds):
    a scale-down of the role waits until the previous one's pods have had this long."""

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Policy:
        a = spec["autoscaling"]
        return cls(
            prefill_min=a["prefill"]["minReplicas"], prefill_max=a["prefill"]["maxReplicas"],
            decode_min=a["decode"]["minReplicas"], decode_max=a["decode"]["maxReplicas"],
            ratio_min=float(a["ratio"]["min"]), ratio_max=float(a["ratio"]["max"]),
            target_prefill_tokens=a["targetQueueTokensPerPrefill"],
            target_decode_tokens=a["targetQueueTokensPerDecode"],
            max_rejection_rate=float(a["maxRejectionRate"]),
            up_window_s=float(a["scaleUpStabilizationSeconds"]),
            down_window_s=float(a["scaleDownStabilizationSeconds"]),
            ttft_slo_ms=float(spec["slo"]["ttftMs"]),
            prefill_step=admission.group_size(spec),
            prefill_grace_s=float(schema_gateway.grace_seconds(
                schema_gateway.drain_seconds(spec, "prefill"))),
            decode_grace_s=float(schema_gateway.grace_seconds(
                schema_gateway.drain_seconds(spec, "decode"))),
        )


@dataclass(frozen=True)
class MetricsSample:
    time: float
    prefill_queue_tokens: float
    decode_load_tokens: float | None
    """None when no Conductor exported it: decode then keeps its count."""
    ttft_headroom_ms: float | None
    rejections_total: float
    requests_total: float


@dataclass(frozen=True)
class Recommendation:
    time: float
    prefill: int
    decode: int


@dataclass
class ScalerState:
    """Per-cluster memory between decisions (kept by the operator, lost on restart)."""

    last_sample: MetricsSample | None = None
    history: deque[Recommendation] = field(default_factory=deque)
    last_down: dict[str, float] = field(default_factory=dict)
    """When each role was last scaled down (sample time)."""


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reason: str


def sample_from_texts(texts: Iterable[str], now: float) -> MetricsSample | None:
    """One sample from the /metrics of every Conductor pod, or None if none had our metrics."""
    pq: list[float] = []
    dl: list[float] = []
    heads: list[float] = []
    rej = req = 0.0
    for text in texts:
        ss = metrics.samples(text)
        p = metrics.total(ss, "mooncake_conductor_queue_tokens", role="prefill")
        d = metrics.total(ss, "mooncake_conductor_decode_load_tokens")
        if p is None and d is None:
            continue
        pq.append(p or 0.0)
        if d is not None:
            dl.append(d)
        h = metrics.total(ss, "mooncake_conductor_predicted_ttft_headroom_ms")
        if h is not None:
            heads.append(h)
        rej += metrics.total(ss, "mooncake_conductor_rejections_total") or 0.0
        req += metrics.total(ss, "mooncake_conductor_requests_total") or 0.0
    if not pq:
        return None
    return MetricsSample(now, max(pq), max(dl) if dl else None, min(heads) if heads else None,
                         rej, req)


def ready_counts(workloads: Mapping[str, Mapping[str, Any]]) -> tuple[int, int] | None:
    """Ready pods of (prefill, decode) from their StatefulSets' `status.readyReplicas` (absent
    while none is ready); None when either StatefulSet is not there to say."""
    out = []
    for role in ("prefill", "decode"):
        sts = workloads.get(role)
        if sts is None:
            return None
        out.append(int((sts.get("status") or {}).get("readyReplicas") or 0))
    return out[0], out[1]


def _by_usage(current: int, queue: float, target: int) -> int:
    if current <= 0:
        return math.ceil(queue / target)
    usage = queue / (target * current)
    if abs(usage - 1.0) <= TOLERANCE:
        return current
    return math.ceil(queue / target - _EPS)


def whole_groups(p: int, step: int, up: bool = True) -> int:
    """`p` prefill pods rounded to whole pipeline groups of `step` (up, or down)."""
    return (-(-p // step) if up else p // step) * step


def clamp(p: int, d: int, pol: Policy) -> tuple[int, int]:
    """Bounds, then the ratio bounds; prefill always lands on whole groups (rounded up where
    capacity is asked for, down where the ratio caps it)."""
    step = pol.prefill_step
    p = min(max(whole_groups(p, step), pol.prefill_min), pol.prefill_max)
    d = min(max(d, pol.decode_min), pol.decode_max)
    if p > d * pol.ratio_max + _EPS:
        need = math.ceil(p / pol.ratio_max - _EPS)
        if need <= pol.decode_max:
            d = need
        else:
            d = pol.decode_max
            p = whole_groups(math.floor(d * pol.ratio_max + _EPS), step, up=False)
    if p < d * pol.ratio_min - _EPS:
        need = whole_groups(math.ceil(d * pol.ratio_min - _EPS), step)
        if need <= pol.prefill_max:
            p = need
        else:
            p = pol.prefill_max
            d = math.floor(p / pol.ratio_min + _EPS)
    return p, d


def recommend(pol: Policy, current: tuple[int, int], sample: MetricsSample,
              previous: MetricsSample | None,
              ready: tuple[int, int] | None = None) -> tuple[Recommendation, list[str]]:
    """This sample's counts before stabilisation; `ready` (None: unknown) tells which desired
    pods are still starting, and a role with any gets no "one more" step."""
    cur_p, cur_d = current
    starting = (max(0, cur_p - ready[0]), max(0, cur_d - ready[1])) if ready else (0, 0)
    step_p, step_d = (0 if n else 1 for n in starting)
    p = _by_usage(cur_p, sample.prefill_queue_tokens, pol.target_prefill_tokens)
    load = sample.decode_load_tokens
    d = cur_d if load is None else _by_usage(cur_d, load, pol.target_decode_tokens)
    why = [f"prefill queue {sample.prefill_queue_tokens:.0f} tokens, decode load "
           + ("unknown" if load is None else f"{load:.0f} tokens")]
    head = sample.ttft_headroom_ms
    if head is not None and head < 0:
        p = max(p, cur_p + step_p)
        why.append(f"TTFT headroom {head:.0f}ms")
    elif head is not None and head < TOLERANCE * pol.ttft_slo_ms:
        p = max(p, cur_p)  # close to the SLO: never shrink prefill here
    if previous is not None:
        d_req = sample.requests_total - previous.requests_total
        d_rej = sample.rejections_total - previous.rejections_total
        if d_req > 0 and d_rej >= 0 and d_rej / d_req > pol.max_rejection_rate:
            p, d = max(p, cur_p + step_p), max(d, cur_d + step_d)
            why.append(f"rejecting {d_rej / d_req:.1%}")
    why += [f"{n} {role} starting" for role, n in zip(ROLES, starting, strict=True) if n]
    p, d = clamp(p, d, pol)
    return Recommendation(sample.time, p, d), why


def _stabilize(cur: int, ups: list[int], downs: list[int], covered: bool) -> int:
    up = min(ups)
    down = max(downs)
    if up > cur:
        return up
    if down < cur and covered:
        return down
    return cur


def _one_drain_at_a_time(pol: Policy, state: ScalerState, current: tuple[int, int],
                         target: tuple[int, int], now: float
                         ) -> tuple[tuple[int, int], list[str]]:
    """Hold scale-downs while a role's previous one may still be draining (within its pods'
    grace period): a stopping decode hands its streams to the ones that stay, which should not
    be stopping too, and the load the next decision reads still counts the moved streams.

    A held role holds every scale-down of this decision: the larger of the current and the
    target count per role keeps the ratio bounds both satisfy. Records when each role was
    scaled down."""
    roles = (("prefill", pol.prefill_grace_s), ("decode", pol.decode_grace_s))
    why = []
    for i, (role, grace) in enumerate(roles):
        since = now - state.last_down.get(role, float("-inf"))
        if target[i] < current[i] and since < grace - _EPS:
            why.append(f"{role} scale-down held: the last one is {since:.0f}s into its "
                       f"{grace:.0f}s drain")
    if why:
        return (max(target[0], current[0]), max(target[1], current[1])), why
    for i, (role, _) in enumerate(roles):
        if target[i] < current[i]:
            state.last_down[role] = now
    return target, why


def decide(pol: Policy, current: tuple[int, int], state: ScalerState,
           sample: MetricsSample, ready: tuple[int, int] | None = None) -> Decision:
    """Replica counts for (prefill, decode) from the desired `current` and the `ready` counts
    (see `ready_counts`); updates `state` with this sample."""
    rec, why = recommend(pol, current, sample, state.last_sample, ready)
    state.last_sample = sample
    state.history.append(rec)
    horizon = max(pol.up_window_s, pol.down_window_s)
    while state.history and state.history[0].time < sample.time - horizon - _EPS:
        state.history.popleft()
    ups = [r for r in state.history if r.time >= sample.time - pol.up_window_s - _EPS]
    downs = [r for r in state.history if r.time >= sample.time - pol.down_window_s - _EPS]
    # Scale-down needs a recommendation history as long as the window, else we guess.
    covered = state.history[0].time <= sample.time - pol.down_window_s + _EPS
    p = _stabilize(current[0], [r.prefill for r in ups], [r.prefill for r in downs], covered)
    d = _stabilize(current[1], [r.decode for r in ups], [r.decode for r in downs], covered)
    p, d = clamp(p, d, pol)
    (p, d), held = _one_drain_at_a_time(pol, state, current, (p, d), sample.time)
    why += held
    if (p, d) == current:
        reason = f"steady at {p}:{d} ({', '.join(why)})"
    else:
        reason = f"prefill {current[0]}->{p}, decode {current[1]}->{d} ({', '.join(why)})"
    return Decision(p, d, reason)
