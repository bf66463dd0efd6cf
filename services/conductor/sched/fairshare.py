"""Fair admission between tenants: a max-min fair share of the Conductor's concurrent requests.

Why: early rejection (`admission`) sheds what its SLO prediction says would miss, but it does not
ask whose requests built the queue behind that prediction. A tenant that floods the Conductor
raises every instance's predicted TTFT, and then everyone's requests, the quiet tenants'
included, are refused: the flood starves the others.

The discipline: **max-min fair sharing of concurrent requests, work-conserving.** The Conductor
is given a concurrency, `capacity`. While fewer than `capacity` requests are in flight, every
request is admitted (to the SLO check) whatever its tenant: a tenant alone may use it all. Once
`capacity` are in flight, a request is admitted only if its tenant holds fewer than its fair
share, `capacity` divided by the tenants with requests in flight (this one counted); the others
are refused at once with a 429 (`TenantOverShare`, Retry-After 1 s). So under overload each
active tenant is guaranteed min(its demand, its share) of the concurrency, a flooding tenant is
cut back to its share (its excess never reaches the instances' queues, so it cannot push the
others' predictions over their SLO), and a quiet tenant's request always gets in. In flight can
exceed `capacity` by at most the quiet tenants' shares, which the flooding tenant's finishing
requests give back.

Resumed streams and a request's retries are one request here: counted once, from the start of
its pipeline run to its end.
"""

from __future__ import annotations

from collections import Counter

from mooncake_k8s.conductor.sched.admission import Overloaded, Verdict

RETRY_AFTER_S = 1


class TenantOverShare(Overloaded):
    """The Conductor is at its concurrency and this request's tenant already holds its fair
    share of it: refused with a 429 before any work is spent (the tenant's other requests go
    on)."""

    def __init__(self, message: str, tenant: str = "", priority: str = "interactive") -> None:
        super().__init__(Verdict(False, "tenant_share", RETRY_AFTER_S), priority)
        self.args = (message,)
        self.tenant = tenant

    def __str__(self) -> str:
        return str(self.args[0])

    @property
    def code(self) -> str:
        return "tenant_share"


class FairShare:
    """Per-tenant in-flight counts and the admission rule in the module docstring. Used from
    one event loop (no lock)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.in_flight: Counter[str] = Counter()
        self.total = 0
        self.refused: Counter[str] = Counter()

    def share(self, tenant: str) -> int:
        """The tenant's fair share now: capacity over the active tenants, itself included
        (at least 1: every active tenant may have one request in flight)."""
        active = len(self.in_flight) + (tenant not in self.in_flight)
        return max(1, self.capacity // active)

    def enter(self, tenant: str, priority: str = "interactive") -> None:
        """Count a request in, or raise TenantOverShare (see the module docstring)."""
        if self.total >= self.capacity:
            held, share = self.in_flight[tenant], self.share(tenant)
            if held >= share:
                self.refused[tenant] += 1
                raise TenantOverShare(
                    f"overloaded: tenant {tenant or '(shared)'!r} already has {held} requests "
                    f"in flight, its fair share ({share}) while the server is at capacity; "
                    f"retry in {RETRY_AFTER_S} s", tenant, priority)
        self.in_flight[tenant] += 1
        self.total += 1

    def leave(self, tenant: str) -> None:
        """Count a request out (its run ended, however it ended)."""
        n = self.in_flight[tenant] - 1
        if n < 0:
            raise ValueError(f"tenant {tenant!r} has no request in flight")
        if n:
            self.in_flight[tenant] = n
        else:
            del self.in_flight[tenant]
        self.total -= 1
