"""store.tenantQuotas: validated by the CRD's rules (each error names the field) and rendered
into the master's MOONCAKE_TENANT_QUOTAS, which the master's --tenant-quota reads back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mooncake_k8s.cli.main import _tenant_quotas
from mooncake_k8s.operator import naming
from mooncake_k8s.operator.metrics import store_usage
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.schema import ROLES
from mooncake_k8s.operator.schema_status import cluster_status_schema
from mooncake_k8s.operator.status import Observed, aggregate
from mooncake_k8s.operator.validation import InvalidResource, validate, validate_cluster
from mooncake_k8s.store.master.quotas import TenantUsage, tenant_metrics

Obj = dict[str, Any]
GiB = 1 << 30


def master_env(make_cluster: Callable[..., Obj], store: Obj) -> dict[str, str]:
    r = render(validate_cluster(make_cluster({"store": store})))
    pod = r.get("StatefulSet", naming.name("demo", "master"))["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "master"]
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def test_quotas_reach_the_master_as_it_reads_them(make_cluster: Callable[..., Obj]) -> None:
    env = master_env(make_cluster, {"tenantQuotas": [
        {"tenant": "team-a", "dram": "1Gi", "ssd": "4Gi"},
        {"tenant": "team-b", "ssd": "512Mi"},
        {"tenant": "", "dram": 1048576},
    ]})
    value = env["MOONCAKE_TENANT_QUOTAS"]
    assert value == f"team-a={GiB},{4 * GiB} team-b=-,{512 << 20} =1048576,-"
    # click splits a `multiple` option's variable on whitespace, as here
    assert _tenant_quotas(tuple(value.split())) == {
        "team-a": (GiB, 4 * GiB), "team-b": (None, 512 << 20), "": (1 << 20, None)}


def test_no_quotas_no_variable(make_cluster: Callable[..., Obj]) -> None:
    assert "MOONCAKE_TENANT_QUOTAS" not in master_env(make_cluster, {})
    assert "MOONCAKE_TENANT_QUOTAS" not in master_env(make_cluster, {"tenantQuotas": []})


@pytest.mark.parametrize(("quotas", "why"), [
    ([{"tenant": "a", "dram": "1Gi"}, {"tenant": "a", "ssd": "1Gi"}],
     "spec.store.tenantQuotas: store.tenantQuotas names a tenant more than once"),
    ([{"tenant": "a"}], "spec.store.tenantQuotas[0]: store.tenantQuotas: a tenant's quota "
                        "needs dram or ssd"),
    ([{"tenant": "a b", "dram": "1Gi"}], "spec.store.tenantQuotas[0].tenant"),
    ([{"tenant": "a", "dram": "lots"}], "spec.store.tenantQuotas[0].dram: 'lots' is not a size"),
    ([{"dram": "1Gi"}], "spec.store.tenantQuotas[0]"),
])
def test_bad_quotas_are_refused_naming_the_field(make_cluster: Callable[..., Obj],
                                                  quotas: list[Obj], why: str) -> None:
    with pytest.raises(InvalidResource) as info:
        validate_cluster(make_cluster({"store": {"tenantQuotas": quotas}}))
    assert any(why in e for e in info.value.errors), info.value.errors


def test_status_reports_each_tenant_from_the_masters_metrics(
        make_cluster: Callable[..., Obj]) -> None:
    """The master's own exposition (quotas.tenant_metrics through a registry) read by the
    operator into status.store.tenants, which the status schema accepts."""
    registry = CollectorRegistry()

    class Tenants:
        def collect(self) -> Iterator[Any]:
            yield from tenant_metrics([
                TenantUsage("team-a", GiB, 0, 3, GiB, None, 12, 1),
                TenantUsage("", 5, 7, 2, None, 64, 0, 0)])

    registry.register(Tenants())  # type: ignore[arg-type]
    text = ('mooncake_store_capacity_bytes{segment="s",tier="dram"} 4096\n'
            + generate_latest(registry).decode())
    usage = store_usage(text)
    assert usage is not None
    c = validate_cluster(make_cluster({}))
    r = render(c)
    status = aggregate(c, r, Observed({}, [], usage), "2026-01-01T00:00:00Z")
    assert status["store"]["tenants"] == [
        {"tenant": "", "dramUsedBytes": 5, "ssdUsedBytes": 7, "ssdQuotaBytes": 64,
         "evictions": 0, "refusals": 0},
        {"tenant": "team-a", "dramUsedBytes": GiB, "ssdUsedBytes": 0, "dramQuotaBytes": GiB,
         "evictions": 12, "refusals": 1}]
    validate(cluster_status_schema(ROLES), status)  # raises if the CRD would refuse it


def test_fair_admission_reaches_the_conductor_only_when_set(
        make_cluster: Callable[..., Obj]) -> None:
    def conductor_env(spec: Obj) -> dict[str, str]:
        r = render(validate_cluster(make_cluster(spec)))
        pod = r.get("Deployment", naming.name("demo", "conductor"))["spec"]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "conductor"]
        return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}

    assert conductor_env({"slo": {"tenantFairShare": 64}})["MOONCAKE_TENANT_FAIR_SHARE"] == "64"
    assert "MOONCAKE_TENANT_FAIR_SHARE" not in conductor_env({})
    with pytest.raises(InvalidResource, match=r"spec\.slo\.tenantFairShare"):
        validate_cluster(make_cluster({"slo": {"tenantFairShare": 0}}))
