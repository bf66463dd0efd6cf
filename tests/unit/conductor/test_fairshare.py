"""Fair admission between tenants (sched.fairshare): a tenant flooding the Conductor is held to
its max-min fair share of the concurrency while another tenant's requests all get in."""

from __future__ import annotations

import pytest

from mooncake_k8s.conductor.http.errors import api_error
from mooncake_k8s.conductor.sched.admission import Overloaded
from mooncake_k8s.conductor.sched.fairshare import FairShare, TenantOverShare


def test_a_tenant_alone_may_use_the_whole_capacity_and_then_is_refused() -> None:
    fs = FairShare(4)
    for _ in range(4):
        fs.enter("a")
    with pytest.raises(TenantOverShare, match="'a' already has 4 requests"):
        fs.enter("a")
    fs.leave("a")
    fs.enter("a")  # below capacity again: admitted
    assert fs.in_flight == {"a": 4} and fs.refused == {"a": 1}


def test_a_quiet_tenant_gets_in_while_a_flooding_one_holds_everything() -> None:
    fs = FairShare(8)
    for _ in range(8):
        fs.enter("flood")
    for _ in range(4):  # its share: 8 over 2 active tenants
        fs.enter("quiet")
    with pytest.raises(TenantOverShare):
        fs.enter("quiet")
    with pytest.raises(TenantOverShare):
        fs.enter("flood")
    assert fs.share("third") == 2  # a third tenant would get 8 // 3


def test_under_a_steady_flood_the_quiet_tenant_is_never_refused() -> None:
    """Each tick every request in flight ends and the flooding tenant sends 20 new ones, the
    quiet one 3: the quiet tenant's requests all get in, the flood never holds more than the
    capacity."""
    fs = FairShare(10)
    live: list[str] = []
    for _ in range(50):
        for t in live:
            fs.leave(t)
        live = []
        for tenant, n in (("flood", 20), ("quiet", 3)):
            for _ in range(n):
                try:
                    fs.enter(tenant)
                    live.append(tenant)
                except TenantOverShare:
                    pass
        assert live.count("quiet") == 3
        assert live.count("flood") <= 10
    assert fs.refused["quiet"] == 0 and fs.refused["flood"] >= 50 * 10


def test_the_refusal_is_a_429_with_retry_after_and_its_own_code() -> None:
    fs = FairShare(1)
    fs.enter("a")
    with pytest.raises(Overloaded) as info:
        fs.enter("a")
    err = api_error(info.value)
    assert err.status == 429 and err.code == "tenant_share"
    assert err.headers is not None and err.headers["Retry-After"] == "1"


def test_bad_use_is_an_error() -> None:
    with pytest.raises(ValueError, match="capacity"):
        FairShare(0)
    with pytest.raises(ValueError, match="no request in flight"):
        FairShare(2).leave("x")
