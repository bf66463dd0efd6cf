"""Prediction-based early rejection: refuse up front what would miss its SLOs anyway.

Under overload, admitting a request that will miss its TTFT or TBT SLO wastes the prefill work
it costs and slows every request behind it. Mooncake instead predicts, at arrival, the TTFT the
request will see (the scheduler's estimate for its chosen prefill instance) and the decode load
it will meet *when it gets to decode* (not the load now: requests already in prefill will have
joined the batch by then, and some running ones will have finished), and rejects with HTTP 429
and a `Retry-After` what would miss.

`DecodeLedger` is that prediction's memory: every request the scheduler sends to a decode
instance, with its predicted arrival and finish and the KV tokens it reserves. The live
Conductor takes the larger of the ledger and the instance's own load report, so several
Conductors (each with its own ledger) still see each other's load.

Request classes share one pair of SLOs but not one threshold: a class may only use its
`slo_fraction` of the SLO, so as predictions rise, `batch` traffic (fraction < 1) is shed while
`interactive` traffic is still admitted, and the capacity that frees goes to the latter.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from mooncake_k8s.common.errors import MooncakeError

PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    """Time to first token; None = no TTFT objective."""
    tbt_ms: float | None = None
    """Time between tokens, as Mooncake measures it: the mean of a request's slowest 10% of
    token intervals. None = no TBT objective."""

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tbt_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (or unset), got {v}")

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tbt_ms is not None

    def met(self, ttft_ms: float, tbt_ms: float) -> bool:
        return ((self.ttft_ms is None or ttft_ms <= self.ttft_ms)
                and (self.tbt_ms is None or tbt_ms <= self.tbt_ms))


@dataclass(frozen=True)
class AdmissionConfig:
    slo: SLO
    class_fraction: dict[str, float] = field(
        default_factory=lambda: {"interactive": 1.0, "batch": 0.5})
    """Share of the SLO a class may be predicted to use and still be admitted. Batch gets
    half: it is shed first, and what it leaves is the interactive traffic's headroom."""
    max_retry_after_s: int = 60

    def __post_init__(self) -> None:
        for name, f in self.class_fraction.items():
            if not 0 < f <= 1:
                raise ValueError(f"class_fraction[{name!r}] must be in (0, 1], got {f}")
        if self.max_retry_after_s < 1:
            raise ValueError("max_retry_after_s must be >= 1")

    def fraction(self, priority: str) -> float:
        try:
            return self.class_fraction[priority]
        except KeyError:
            raise ValueError(f"unknown request class {priority!r}; known: "
                             f"{sorted(self.class_fraction)}") from None


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str = ""
    """'' when admitted; 'ttft', 'tbt' or 'kv' (no decode instance has room) otherwise."""
    retry_after_s: int = 0
    headroom_ms: float = math.inf
    """TTFT SLO minus the predicted TTFT (inf without a TTFT objective)."""


class Overloaded(MooncakeError):
    """An SLO miss predicted at arrival: the request is refused before any work is spent on
    it. `retry_after_s` says when the prediction expects room again (the HTTP layer sends it
    as a 429's `Retry-After`; clients and load balancers back off by it)."""

    def __init__(self, verdict: Verdict, priority: str) -> None:
        what = {"ttft": "time to first token", "tbt": "time between tokens",
                "kv": "decode KV memory"}.get(verdict.reason, verdict.reason)
        super().__init__(f"overloaded: this {priority} request is predicted to miss its "
                         f"{what} objective; retry in {verdict.retry_after_s} s")
        self.verdict = verdict
        self.priority = priority

    @property
    def code(self) -> str:
        return f"slo_{self.verdict.reason}"

    @property
    def retry_after_s(self) -> int:
        return self.verdict.retry_after_s


def judge(config: AdmissionConfig, priority: str, ttft_ms: float, tbt_ms: float,
          kv_fits: bool, tbt_clears_in_ms: float = 0.0) -> Verdict:
    """Admit or reject one request from its predictions; pure.

    `tbt_clears_in_ms`: when the chosen decode instance is predicted to lose its next
    sequence; a TBT rejection asks the client to come back about then."""
    slo = config.slo
    frac = config.fraction(priority)
    headroom = (slo.ttft_ms - ttft_ms) if slo.ttft_ms is not None else math.inf
    if slo.ttft_ms is not None and ttft_ms > slo.ttft_ms * frac:
        over = ttft_ms - slo.ttft_ms * frac
        return Verdict(False, "ttft", _retry(over, config), headroom)
    if not kv_fits:
        return Verdict(False, "kv", _retry(tbt_clears_in_ms, config), headroom)
    if slo.tbt_ms is not None and tbt_ms > slo.tbt_ms * frac:
        return Verdict(False, "tbt", _retry(tbt_clears_in_ms, config), headroom)
    return Verdict(True, "", 0, headroom)


def _retry(ms: float, config: AdmissionConfig) -> int:
    if not math.isfinite(ms):
        return config.max_retry_after_s
    return max(1, min(config.max_retry_after_s, math.ceil(ms / 1000.0)))


class DecodeLedger:
    """Per decode slot: the requests routed there and not yet predicted to have finished.

    `seqs[s]` and `tokens[s]` count them (tokens = the KV they reserve: prompt + output);
    `at(s, t)` is the same for a future time t, without those predicted to finish by then.
    Expiry is driven by one heap over all slots, so a decision touches only the slots whose
    requests actually finished."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.tokens: list[int] = []
        self.load: list[float] = []
        """Per slot, `per_seq * seqs + per_token * tokens` with the weights of `weigh`: the
        decode step-time terms the scheduler ranks instances by, kept current here so that a
        decision reads them instead of computing them for every instance."""
        self.weights: tuple[float, float] = (0.0, 0.0)
        self._finish: list[list[float]] = []
        self._tok: list[list[int]] = []
        self._heap: list[tuple[float, int, int, int]] = []
        self._ids = itertools.count()

    def weigh(self, per_seq: float, per_token: float) -> None:
        """Set the weights of `load` (the cost model's, as floats) and recompute it."""
        self.weights = (float(per_seq), float(per_token))
        per_seq, per_token = self.weights
        self.load = [per_seq * s + per_token * t
                     for s, t in zip(self.seqs, self.tokens, strict=True)]

    def _reload(self, slot: int) -> None:
        ps, pt = self.weights
        self.load[slot] = ps * self.seqs[slot] + pt * self.tokens[slot]

    def ensure(self, slots: int) -> None:
        while len(self.seqs) < slots:
            self.seqs.append(0)
            self.tokens.append(0)
            self.load.append(self.weights[0] * 0 + self.weights[1] * 0)
            self._finish.append([])
            self._tok.append([])

    def add(self, slot: int, finish_ms: float, tokens: int) -> None:
        self.ensure(slot + 1)
        self.seqs[slot] += 1
        self.tokens[slot] += tokens
        self._reload(slot)
        fin = self._finish[slot]
        i = bisect.bisect_right(fin, finish_ms)
        fin.insert(i, finish_ms)
        self._tok[slot].insert(i, tokens)
        heapq.heappush(self._heap, (finish_ms, next(self._ids), slot, tokens))

    def expire(self, now_ms: float) -> None:
        heap = self._heap
        if not heap or heap[0][0] > now_ms:
            return
        dirty: set[int] = set()
        while heap and heap[0][0] <= now_ms:
            _, _, slot, _ = heapq.heappop(heap)
            dirty.add(slot)
        for slot in dirty:
            fin = self._finish[slot]
            k = bisect.bisect_right(fin, now_ms)
            self.seqs[slot] -= k
            self.tokens[slot] -= sum(self._tok[slot][:k])
            del fin[:k]
            del self._tok[slot][:k]
            self._reload(slot)

    def at(self, slot: int, t_ms: float) -> tuple[int, int]:
        """(sequences, reserved tokens) predicted at time t_ms."""
        if slot >= len(self.seqs):
            return 0, 0
        fin = self._finish[slot]
        k = bisect.bisect_right(fin, t_ms)
        return self.seqs[slot] - k, self.tokens[slot] - sum(self._tok[slot][:k])

    def next_finish(self, slot: int) -> float:
        if slot >= len(self.seqs) or not self._finish[slot]:
            return math.inf
        return self._finish[slot][0]

    def forget(self, slot: int) -> None:
        """Drop a slot's bookkeeping (its instance left); heap entries expire harmlessly."""
        if slot < len(self.seqs):
            self.seqs[slot] = self.tokens[slot] = 0
            self._reload(slot)
            self._finish[slot].clear()
            self._tok[slot].clear()
