"""Tenant quotas on MasterState (fake clock): a tenant over its share evicts only its own
coldest objects, a put it cannot make room for is refused with QuotaExceeded, and the counts
the master reports are what it holds."""

from __future__ import annotations

import pytest
from test_metadata import (  # type: ignore[import-not-found]  # (tests/unit/store/)
    Clock,
    KiB,
    found,
    make,
    node,
)

from mooncake_k8s.common.errors import InvalidArgument, NoSpace, QuotaExceeded
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.quotas import Quota, parse_quota_flag, parse_size
from mooncake_k8s.store.master.state import MasterState
from mooncake_k8s.store.wire import code_error, code_of

MiB = 1 << 20


@pytest.fixture
def clock() -> Clock:
    return Clock()


def put(st: MasterState, key: str, tenant: str, size: int = KiB) -> None:
    r = st.put_start(key, size, tenant=tenant)
    assert not r.exists
    st.put_end(key, r.put_id, 1)


def tenant_row(st: MasterState, tenant: str) -> pb.TenantQuotaStats:
    return next(t for t in st.stats().tenants if t.tenant == tenant)


def test_tenant_over_quota_evicts_its_own_oldest_never_another_tenants(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=4 * KiB)})
    node(st, "n", dram=8 * MiB)
    for i in range(4):
        put(st, f"b{i}", "b")
    for i in range(12):  # 3x its quota
        put(st, f"a{i}", "a")
        assert tenant_row(st, "a").dram_used <= 4 * KiB
    assert found(st, [f"a{i}" for i in range(12)]) == [False] * 8 + [True] * 4
    assert found(st, [f"b{i}" for i in range(4)]) == [True] * 4
    row = tenant_row(st, "a")
    assert (row.dram_used, row.objects, row.dram_quota, row.evictions, row.refusals) == (
        4 * KiB, 4, 4 * KiB, 8, 0)


def test_leased_objects_are_kept_and_a_put_that_cannot_make_room_is_refused(
        clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=2 * KiB)})
    node(st, "n", dram=8 * MiB)
    put(st, "a0", "a")
    put(st, "a1", "a")
    lk = st.get_replicas(["a0", "a1"])  # read leases: neither may go
    with pytest.raises(QuotaExceeded, match="at its DRAM quota"):
        st.put_start("a2", KiB, tenant="a")
    st.release_lease(lk.lease_id)
    put(st, "a2", "a")  # now the oldest goes
    assert found(st, ["a0", "a1", "a2"]) == [False, True, True]
    assert tenant_row(st, "a").refusals == 1


def test_an_object_larger_than_the_quota_is_refused_as_a_no_space(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=2 * KiB)})
    node(st, "n", dram=8 * MiB)
    with pytest.raises(NoSpace, match="larger than its DRAM quota"):
        st.put_start("big", 4 * KiB, tenant="a")
    res = st.batch_put_start([pb.PutStartRequest(key="big", size=4 * KiB, tenant="a")])
    assert res[0].code == pb.ERROR_QUOTA_EXCEEDED
    assert isinstance(code_error(res[0].code, res[0].error), QuotaExceeded)
    assert code_of(QuotaExceeded("x")) == pb.ERROR_QUOTA_EXCEEDED


def test_space_lease_commits_count_against_the_leases_tenant(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=3 * KiB)})
    node(st, "n", dram=8 * MiB)
    put(st, "b0", "b")
    lease = st.lease_space(64 * KiB, KiB, tenant="a")
    items = [pb.CommitItem(key=f"a{i}", offset=i * KiB, size=KiB, checksum=1) for i in range(6)]
    resp = st.put_commit(lease.lease_id, items, release=True)
    assert list(resp.errors) == [""] * 6
    assert found(st, [f"a{i}" for i in range(6)]) == [False] * 3 + [True] * 3
    assert found(st, ["b0"]) == [True]
    assert tenant_row(st, "a").dram_used == 3 * KiB


def test_untracked_tenants_are_unlimited_and_unreported(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=KiB)})
    node(st, "n", dram=8 * MiB)
    for i in range(20):
        put(st, f"s{i}", "")
        put(st, f"c{i}", "c")
    assert all(found(st, [f"s{i}" for i in range(20)] + [f"c{i}" for i in range(20)]))
    assert [t.tenant for t in st.stats().tenants] == ["a"]


def test_a_lowered_quota_is_applied_by_the_next_tick(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=8 * KiB)})
    node(st, "n", dram=8 * MiB)
    for i in range(8):
        put(st, f"a{i}", "a")
    st.quotas.set_quota("a", Quota(dram=2 * KiB))
    st.tick()
    assert found(st, [f"a{i}" for i in range(8)]) == [False] * 6 + [True] * 2


def test_parsing_sizes_and_quota_flags() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512mib") == 512 << 20
    assert parse_size("4096") == 4096
    assert parse_size("1.5k") == 1536
    assert parse_quota_flag("acme=1GiB,4GiB") == ("acme", Quota(1 << 30, 4 << 30))
    assert parse_quota_flag("=64MiB") == ("", Quota(64 << 20, None))
    assert parse_quota_flag("acme=-,1GiB") == ("acme", Quota(None, 1 << 30))
    for bad, why in [("acme", "NAME=DRAM"), ("acme=lots", "expected a number"),
                     ("acme=1G,2G,3G", "at most two"), ("a b=1G", "whitespace")]:
        with pytest.raises(InvalidArgument, match=why):
            parse_quota_flag(bad)


def test_a_lookup_makes_an_object_its_tenants_warmest(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=2 * KiB)})
    node(st, "n", dram=8 * MiB)
    put(st, "a0", "a")
    put(st, "a1", "a")
    assert found(st, ["a0"]) == [True]  # read: a1 is now the coldest
    put(st, "a2", "a")
    assert found(st, ["a0", "a1", "a2"]) == [True, False, True]


def test_ssd_bytes_count_against_the_ssd_quota(clock: Clock) -> None:
    st = make(clock, tenant_quotas={"a": Quota(dram=None, ssd=4 * KiB)})
    node(st, "n", dram=KiB, ssd=8 * MiB)  # too small for any object: puts go to the SSD
    for i in range(5):
        put(st, f"a{i}", "a", size=2 * KiB)
    row = tenant_row(st, "a")
    assert (row.dram_used, row.ssd_used, row.ssd_quota) == (0, 4 * KiB, 4 * KiB)
    assert found(st, [f"a{i}" for i in range(5)]) == [False] * 3 + [True] * 2


def test_objects_removed_elsewhere_stop_counting_without_costing_evictions(
        clock: Clock) -> None:
    """The running count still holds removed objects; when it says no room can be made, the
    master counts exactly instead of refusing or evicting what fits."""
    st = make(clock, tenant_quotas={"a": Quota(dram=2 * KiB)})
    node(st, "n", dram=8 * MiB)
    put(st, "a0", "a")
    put(st, "a1", "a")
    put(st, "keep", "b")
    assert st.remove(["a0", "a1"]) == [True, True]
    lk = st.get_replicas(["keep"])
    put(st, "a2", "a")
    put(st, "a3", "a")
    st.release_lease(lk.lease_id)
    assert found(st, ["a2", "a3", "keep"]) == [True, True, True]
    row = tenant_row(st, "a")
    assert (row.dram_used, row.objects, row.evictions, row.refusals) == (2 * KiB, 2, 0, 0)
