"""store.tenantQuotas: validated by the CRD's rules (each error names the field) and rendered
into the master's MOONCAKE_TENANT_QUOTAS, which the master's --tenant-quota reads back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mooncake_k8s.cli.main import _tenant_quotas
from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

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
