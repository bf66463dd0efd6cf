"""Decode bookings between Conductor replicas: what this Conductor sent to a decode instance
that the instance's latest load report does not count yet.

N Conductors behind one Service each see a decode instance through its load report (running
sequences, KV used: everyone's streams, as of the poll) plus what they booked themselves since.
Without knowing which of its own bookings a report already counts, a Conductor either counts
them twice (never routes to a busy-looking idle instance) or not at all (over-commits between
polls). The decode reports a monotonic count of the streams it admitted
(`LoadReport.accepted_streams`); each time it moves by k, this Conductor drops its k oldest
pending bookings there: those the report now counts in `running`.

The error bound: a step of k may include another replica's admissions, which then drop bookings
of ours that are not yet admitted (still in prefill). So a Conductor undercounts an instance by
at most the other replicas' admissions there since its latest poll (one poll interval of
them), plus streams admitted but still loading their KV (counted by the step, not yet in
`running`). It never overcounts past a poll. A decode that restarted (the count went down)
starts a new count; its old streams died with it, so the pending ones are dropped. A booking
that never reaches the decode (its prefill failed, the client left) is dropped after
`max_age_s`, or earlier by any admission there.

A decode that has never reported a count (a version without the field, during a rollout; or
one that has admitted nothing yet) keeps bookings only `uncounted_age_s` (a few polls): by
then its `running` shows them, as before the count existed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mooncake_k8s.common.rpc import serving_pb2 as pb


@dataclass
class _Instance:
    report: pb.LoadReport | None = None
    """The report last reconciled (a new poll's report is a new object)."""
    accepted: int = 0
    pending: deque[tuple[float, int]] = field(default_factory=deque)
    """(monotonic booking time, tokens) of bookings not yet counted, oldest first."""
    tokens: int = 0
    counting: bool = False
    """The instance has reported a count above 0: it keeps one."""


class DecodeBookings:
    """Per decode instance (by address): this Conductor's uncounted bookings."""

    def __init__(self, max_age_s: float = 120.0, uncounted_age_s: float = 2.0) -> None:
        self.max_age_s = max_age_s
        self.uncounted_age_s = uncounted_age_s
        self._by_addr: dict[str, _Instance] = {}

    def book(self, address: str, tokens: int, report: pb.LoadReport | None,
             now: float | None = None) -> None:
        """A stream routed to `address`, reserving `tokens` of KV (prompt + output), decided
        on `report` (the count it shows cannot include this booking)."""
        st = self._by_addr.get(address)
        if st is None:
            st = self._by_addr[address] = _Instance()
            if report is not None:
                st.report, st.accepted = report, int(report.accepted_streams)
                st.counting = st.accepted > 0
        st.pending.append((time.monotonic() if now is None else now, tokens))
        st.tokens += tokens

    def pending(self, address: str, report: pb.LoadReport | None,
                now: float | None = None) -> tuple[int, int]:
        """(streams, tokens) booked at `address` that `report` does not count yet."""
        st = self._by_addr.get(address)
        if st is None:
            return 0, 0
        if report is not None and report is not st.report:
            self._reconcile(st, report)
        age = self.max_age_s if st.counting else self.uncounted_age_s
        cutoff = (time.monotonic() if now is None else now) - age
        q = st.pending
        while q and q[0][0] < cutoff:
            st.tokens -= q.popleft()[1]
        return len(q), st.tokens

    @staticmethod
    def _reconcile(st: _Instance, report: pb.LoadReport) -> None:
        acc = int(report.accepted_streams)
        st.counting = st.counting or acc > 0
        first = st.report is None
        st.report = report
        if first:  # booked without a report (not done by the router): a count starts here
            st.accepted = acc
            return
        if acc < st.accepted:  # the decode restarted: its old streams are gone
            st.pending.clear()
            st.tokens = 0
            st.accepted = acc
            return
        step = acc - st.accepted
        st.accepted = acc
        q = st.pending
        for _ in range(min(step, len(q))):
            st.tokens -= q.popleft()[1]
