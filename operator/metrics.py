"""Reading the Prometheus text our components expose, for status and autoscaling.

The operator scrapes the store master (capacity, usage, hit rate) and each Conductor pod
(queues, TTFT headroom, rejections). Parsing lives here so the pure consumers (`status`,
`autoscaler`) take plain numbers and the tests feed them synthetic text.

Metric names this module assumes (the Conductor's are agreed in the operator issue):
`mooncake_store_capacity_bytes`, `mooncake_store_used_bytes`, `mooncake_store_lookups_total
{result=hit|miss}` from the master; `mooncake_conductor_queue_tokens{role}`,
`mooncake_conductor_decode_load_tokens`, `mooncake_conductor_predicted_ttft_headroom_ms`,
`mooncake_conductor_rejections_total`, `mooncake_conductor_requests_total` from the Conductor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]


def samples(text: str) -> list[Sample]:
    """Every sample in an exposition; malformed text yields what parsed before the error."""
    out: list[Sample] = []
    try:
        for fam in text_string_to_metric_families(text):
            out.extend((s.name, dict(s.labels), float(s.value)) for s in fam.samples)
    except ValueError:
        pass
    return out


def total(ss: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples with this name whose labels include `labels`; None if there are none."""
    vals = [v for n, lab, v in ss if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return sum(vals) if vals else None


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's row of the master's per-tenant metrics (tenants with a quota)."""

    tenant: str
    dram_used: int
    ssd_used: int
    dram_quota: int | None
    ssd_quota: int | None
    evictions: int
    refusals: int


@dataclass(frozen=True)
class StoreUsage:
    capacity_bytes: int
    used_bytes: int
    hit_rate: float | None
    tenants: tuple[TenantUsage, ...] = ()


def tenant_usage(ss: list[Sample]) -> tuple[TenantUsage, ...]:
    """`mooncake_store_tenant_*{tenant}` samples as rows, by tenant name."""
    names = sorted({lab["tenant"] for n, lab, _ in ss
                    if n == "mooncake_store_tenant_used_bytes" and "tenant" in lab})

    def get(name: str, tenant: str, **labels: str) -> int | None:
        v = total(ss, name, tenant=tenant, **labels)
        return None if v is None else int(v)

    return tuple(TenantUsage(
        t, get("mooncake_store_tenant_used_bytes", t, tier="dram") or 0,
        get("mooncake_store_tenant_used_bytes", t, tier="ssd") or 0,
        get("mooncake_store_tenant_quota_bytes", t, tier="dram"),
        get("mooncake_store_tenant_quota_bytes", t, tier="ssd"),
        get("mooncake_store_tenant_evictions_total", t) or 0,
        get("mooncake_store_tenant_refusals_total", t) or 0) for t in names)


def store_usage(text: str) -> StoreUsage | None:
    ss = samples(text)
    cap = total(ss, "mooncake_store_capacity_bytes")
    if cap is None:
        return None
    used = total(ss, "mooncake_store_used_bytes") or 0.0
    hits = total(ss, "mooncake_store_lookups_total", result="hit") or 0.0
    misses = total(ss, "mooncake_store_lookups_total", result="miss") or 0.0
    rate = hits / (hits + misses) if hits + misses > 0 else None
    return StoreUsage(int(cap), int(used), rate, tenant_usage(ss))
