"""Tenant quotas: each tenant's share of the pool (DRAM and SSD bytes), enforced at put time.

Why: keys are salted per tenant, but without a bound one tenant's writes evict everyone else's
prefixes through the segments' shared LRU. With a quota, a tenant that is over its share makes
room by evicting ITS OWN coldest objects first, never another tenant's; when it cannot (what it
holds is leased, pinned or being copied, or the object alone is larger than the quota) the put
is refused with `QuotaExceeded` (a `NoSpace`: a writer that treats a full store as a miss treats
this one the same way).

Enforced twice, both under the master's lock:
- before placement (`admit`): the tenant's DRAM bytes plus the new object's replicas must fit
  its DRAM quota (an object is placed in DRAM first); its coldest objects go until they do;
- after an object is published (`published`) and on every tick (`trim`): puts in flight at
  once, spills to SSD and added replicas can take a tenant over, so its coldest objects (never
  the one just published) go until it is back within both quotas.

A tenant's objects are kept in least-recently-used order (a put or a lookup makes an object the
tenant's warmest): the front is its coldest. Its bytes are counted as its objects are
published and evicted for its quota, so a put costs only the objects it evicts; they are
counted exactly (one pass over its objects) every `RECOUNT_S` on the master's tick, and when
the count says no room can be made. Between recounts, replicas added by spills, promotions,
hot-block keeps and fan-out are not counted yet (a tenant may pass its quota by them for up to
`RECOUNT_S`), and bytes evicted or removed by others still are (it only evicts sooner).
Tenants without a quota (and the shared "" tenant unless it has one) are not tracked at all
and cost nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from mooncake_k8s.common import tenants
from mooncake_k8s.common.errors import InvalidArgument, QuotaExceeded
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.records import COPYING, DRAM, LEASE, PINNED, Obj

log = logging.getLogger(__name__)

__all__ = ["Quota", "QuotaExceeded", "TenantQuotas", "TenantUsage", "parse_quota_flag",
           "parse_size"]

MAX_TENANT_BYTES = 128
RECOUNT_S = 1.0
"""How often the master counts each tenant's bytes exactly (on its tick)."""


@dataclass(frozen=True)
class Quota:
    """A tenant's share: bytes of DRAM and of SSD (None: unlimited in that tier)."""

    dram: int | None = None
    ssd: int | None = None


def parse_size(text: str) -> int:
    """`1GiB`, `512MiB`, `1g`, `4096` -> bytes (`common.tenants.parse_size`, the API-keys
    file's sizes); InvalidArgument for anything else."""
    try:
        return tenants.parse_size(text)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def parse_quota_flag(text: str) -> tuple[str, Quota]:
    """`NAME=DRAM[,SSD]` (the master's `--tenant-quota`) -> (tenant, Quota). An empty NAME is
    the shared tenant; an empty or `-` size leaves that tier unlimited."""
    name, sep, sizes = text.partition("=")
    if not sep:
        raise InvalidArgument(f"--tenant-quota {text!r}: expected NAME=DRAM[,SSD], e.g. "
                              "acme=1GiB,4GiB")
    check_tenant(name)
    parts = sizes.split(",")
    if len(parts) > 2:
        raise InvalidArgument(f"--tenant-quota {text!r}: at most two sizes (DRAM,SSD)")
    vals = [None if p.strip() in ("", "-") else parse_size(p) for p in parts]
    return name, Quota(vals[0], vals[1] if len(vals) > 1 else None)


def check_tenant(name: str) -> str:
    if len(name.encode()) > MAX_TENANT_BYTES or any(c.isspace() or ord(c) < 32 for c in name):
        raise InvalidArgument(f"tenant {name!r}: at most {MAX_TENANT_BYTES} bytes, no "
                              "whitespace or control characters")
    return name


@dataclass
class TenantCounters:
    evictions: int = 0
    refusals: int = 0


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's row of `TenantQuotas.report`: what it holds against its quota."""

    tenant: str
    dram_used: int
    ssd_used: int
    objects: int
    dram_quota: int | None
    ssd_quota: int | None
    evictions: int
    refusals: int

    def to_pb(self) -> pb.TenantQuotaStats:
        return pb.TenantQuotaStats(
            tenant=self.tenant, dram_used=self.dram_used, ssd_used=self.ssd_used,
            objects=self.objects, dram_quota=self.dram_quota or 0,
            ssd_quota=self.ssd_quota or 0, evictions=self.evictions, refusals=self.refusals)


def _bytes(obj: Obj) -> tuple[int, int]:
    """(DRAM, SSD) bytes of an object's replicas."""
    size, reps = obj.size, obj.reps
    dram = sum(size for r in reps if r.seg.tier == DRAM)
    return dram, len(reps) * size - dram


class TenantQuotas:
    """Per-tenant ownership, usage and quota enforcement; a part of `state.MasterState` (its
    lock is held around every call)."""

    def __init__(self, catalog: Catalog, quotas: Mapping[str, Quota] | None = None) -> None:
        self._cat = catalog
        self.quotas: dict[str, Quota] = dict(quotas or {})
        self._keys: dict[str, OrderedDict[str, None]] = {}  # tenant -> its keys, coldest first
        self.owners: dict[str, str] = {}
        """key -> tenant, for the objects of tenants with a quota (empty: nothing to track)."""
        self.counters: dict[str, TenantCounters] = {}
        self._used: dict[str, list[int]] = {}
        """tenant -> [DRAM, SSD] bytes as counted (see the module docstring)."""
        self._next_recount = 0.0

    def set_quota(self, tenant: str, quota: Quota | None) -> None:
        """Set (or with None drop) a tenant's quota; applied by the next put and tick."""
        check_tenant(tenant)
        if quota is None:
            self.quotas.pop(tenant, None)
        else:
            self.quotas[tenant] = quota
        self._next_recount = 0.0

    def tracked(self, tenant: str) -> bool:
        return tenant in self.quotas

    # -- usage ---------------------------------------------------------------------------------

    def _live(self, tenant: str) -> Iterable[Obj]:
        """The tenant's visible objects, oldest first; forgets keys that are gone."""
        keys = self._keys.get(tenant)
        if not keys:
            return []
        objects = self._cat.objects
        out, gone = [], []
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.hidden:
                gone.append(key)
            else:
                out.append(obj)
        for key in gone:
            del keys[key]
            self.owners.pop(key, None)
        return out

    def usage(self, tenant: str) -> tuple[int, int, int]:
        """(DRAM bytes, SSD bytes, objects) the tenant holds, every replica counted."""
        dram = ssd = n = 0
        for obj in self._live(tenant):
            n += 1
            size = obj.size
            for rep in obj.reps:
                if rep.seg.tier == DRAM:
                    dram += size
                else:
                    ssd += size
        return dram, ssd, n

    # -- enforcement ---------------------------------------------------------------------------

    def _estimate(self, tenant: str) -> list[int]:
        """The tenant's [DRAM, SSD] bytes as counted at puts and quota evictions (see the
        module docstring: `recount` makes it exact)."""
        used = self._used.get(tenant)
        return used if used is not None else self.recount(tenant)

    def recount(self, tenant: str) -> list[int]:
        """Count the tenant's bytes exactly (one pass over its objects)."""
        dram, ssd, _ = self.usage(tenant)
        used = self._used[tenant] = [dram, ssd]
        return used

    def admit(self, tenant: str, size: int, replicas: int) -> None:
        """Make room in the tenant's DRAM quota for a new object of `size` x `replicas`, by
        evicting its own coldest objects; QuotaExceeded when that cannot be done."""
        quota = self.quotas.get(tenant)
        if quota is None or quota.dram is None:
            return
        need = size * replicas
        if need > quota.dram:
            self._refuse(tenant, f"tenant {tenant!r}: an object of {size} bytes x{replicas} "
                                 f"is larger than its DRAM quota of {quota.dram} bytes")
        if not self._shrink(tenant, quota.dram - need, quota.ssd, keep=""):
            dram = self._estimate(tenant)[0]
            self._refuse(tenant, f"tenant {tenant!r} is at its DRAM quota ({dram} of "
                                 f"{quota.dram} bytes used) and none of its objects can be "
                                 "evicted now (leased, pinned or being copied)")

    def published(self, key: str, tenant: str) -> None:
        """Record a new object's tenant and bring the tenant back within its quota (never
        evicting `key` itself)."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return
        used = self._used.get(tenant)
        self._keys.setdefault(tenant, OrderedDict())[key] = None
        self.owners[key] = tenant
        if used is None:
            self.recount(tenant)  # (counts `key` too)
        else:
            d, s = _bytes(self._cat.objects[key])
            used[0] += d
            used[1] += s
        self._shrink(tenant, quota.dram, quota.ssd, keep=key)

    def touch(self, objs: Iterable[Obj]) -> None:
        """Objects just looked up become their tenants' warmest (last to be evicted)."""
        owners, keys = self.owners, self._keys
        for obj in objs:
            tenant = owners.get(obj.key)
            if tenant is not None:
                keys[tenant].move_to_end(obj.key)

    def trim(self) -> None:
        """Bring every tenant within its quota; every RECOUNT_S its bytes are counted exactly
        first (spills, added replicas and other evictions move bytes too)."""
        now = self._cat.now()
        exact = now >= self._next_recount
        if exact:
            self._next_recount = now + RECOUNT_S
        for tenant, quota in self.quotas.items():
            if exact:
                self.recount(tenant)
            self._shrink(tenant, quota.dram, quota.ssd, keep="")

    def _shrink(self, tenant: str, dram_max: int | None, ssd_max: int | None,
                keep: str) -> bool:
        """Evict the tenant's coldest evictable objects until its DRAM bytes are <= dram_max
        and its SSD bytes <= ssd_max; whether it got there. Walks its objects from the coldest
        only as far as it must; when the count says it cannot get there, counts exactly
        (objects evicted or removed elsewhere still counted) and tries once more."""
        def within(u: list[int]) -> bool:
            return (dram_max is None or u[0] <= dram_max) and (ssd_max is None or u[1] <= ssd_max)

        used = self._estimate(tenant)
        if within(used):
            return True
        self._evict_coldest(tenant, used, dram_max, ssd_max, keep)
        if within(used):
            return True
        used = self.recount(tenant)
        if not within(used):
            self._evict_coldest(tenant, used, dram_max, ssd_max, keep)
        return within(used)

    def _evict_coldest(self, tenant: str, used: list[int], dram_max: int | None,
                       ssd_max: int | None, keep: str) -> None:
        """One pass of `_shrink` from the coldest object: evicts and updates `used`."""
        keys = self._keys.get(tenant)
        if not keys:
            return
        objects = self._cat.objects
        victims: list[tuple[Obj, int, int]] = []
        gone: list[str] = []
        dram, ssd = used
        for key in keys:
            dram_over = dram_max is not None and dram > dram_max
            ssd_over = ssd_max is not None and ssd > ssd_max
            if not dram_over and not ssd_over:
                break
            obj = objects.get(key)
            if obj is None or obj.hidden:
                gone.append(key)
                continue
            if key == keep or obj.state >= LEASE or obj.state & (COPYING | PINNED):
                continue
            d, s = _bytes(obj)
            if (dram_over and d) or (ssd_over and s):  # it frees bytes in a tier that is over
                victims.append((obj, d, s))
                dram -= d
                ssd -= s
        for key in gone:
            del keys[key]
            self.owners.pop(key, None)
        for obj, d, s in victims:
            self._evict(tenant, obj)
            used[0] -= d
            used[1] -= s

    def _evict(self, tenant: str, obj: Obj) -> None:
        for rep in obj.reps:
            self._cat.drop_rep(obj, rep, pb.BlockEvent.EVICTED)
        self._cat.evictions += 1
        self._keys[tenant].pop(obj.key, None)
        self.owners.pop(obj.key, None)
        self.counters.setdefault(tenant, TenantCounters()).evictions += 1
        log.debug("quota eviction", extra={"key": obj.key, "tenant": tenant})

    def _refuse(self, tenant: str, msg: str) -> None:
        self.counters.setdefault(tenant, TenantCounters()).refusals += 1
        raise QuotaExceeded(msg)

    # -- reporting -----------------------------------------------------------------------------

    def report(self) -> list[TenantUsage]:
        """One row per tenant with a quota: usage, quota and counters (for stats and metrics)."""
        rows: list[TenantUsage] = []
        for tenant, quota in sorted(self.quotas.items()):
            dram, ssd, n = self.usage(tenant)
            c = self.counters.get(tenant, TenantCounters())
            rows.append(TenantUsage(tenant, dram, ssd, n, quota.dram, quota.ssd, c.evictions,
                                    c.refusals))
        return rows


def tenant_metrics(rows: list[TenantUsage]) -> Iterator[Metric]:
    """Prometheus families of `TenantQuotas.report` rows (labels: tenant, tier)."""
    used = GaugeMetricFamily("mooncake_store_tenant_used_bytes",
                             "Bytes a tenant holds (every replica)", labels=["tenant", "tier"])
    quota = GaugeMetricFamily("mooncake_store_tenant_quota_bytes",
                              "A tenant's quota (absent: unlimited)", labels=["tenant", "tier"])
    ev = CounterMetricFamily("mooncake_store_tenant_evictions",
                             "A tenant's own objects evicted to keep it within its quota",
                             labels=["tenant"])
    ref = CounterMetricFamily("mooncake_store_tenant_refusals",
                              "Puts refused as over the tenant's quota", labels=["tenant"])
    for row in rows:
        t = row.tenant
        for tier, u, q in (("dram", row.dram_used, row.dram_quota),
                           ("ssd", row.ssd_used, row.ssd_quota)):
            used.add_metric([t, tier], u)
            if q is not None:
                quota.add_metric([t, tier], q)
        ev.add_metric([t], row.evictions)
        ref.add_metric([t], row.refusals)
    yield from (used, quota, ev, ref)
