"""Tenant quotas with a real master and storage node: two tenants write at once, tenant A three
times its quota. A's usage never exceeds its quota, B's objects all stay readable (A evicts
only its own), and an object larger than the quota is refused with the typed error."""

from __future__ import annotations

import threading

import pytest

from mooncake_k8s.common.errors import NoSpace, QuotaExceeded
from mooncake_k8s.store.testing import StoreCluster, metric_value

KiB = 1 << 10
MiB = 1 << 20
SIZE = 64 * KiB
QUOTA = 2 * MiB


def blob(tag: int, i: int) -> bytes:
    return bytes([(tag * 31 + i) % 251]) * (SIZE - 1) + bytes([i % 256])


def test_quotas_hold_under_concurrent_writers_of_two_tenants() -> None:
    with StoreCluster() as cluster:
        cluster.start_master("--tenant-quota", f"a={QUOTA}", "--tenant-quota", "b=64MiB")
        cluster.start_node("n0", "128MiB")
        a_keys = [f"a{i}" for i in range(3 * QUOTA // SIZE)]  # 3x its quota
        b_keys = [f"b{i}" for i in range(24)]
        errors: list[BaseException] = []
        samples: list[int] = []
        done = threading.Event()

        def write(keys: list[str], tenant: str, tag: int) -> None:
            try:
                with cluster.client() as c:
                    for i in range(0, len(keys), 4):
                        batch = keys[i:i + 4]
                        errs = c.batch_put(batch, [blob(tag, i + j) for j in range(len(batch))],
                                           tenant=tenant)
                        assert errs == [None] * len(batch), errs
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        def sample() -> None:
            with cluster.client() as c:
                while not done.is_set():
                    rows = {t.tenant: t for t in c.stats().tenants}
                    samples.append(rows["a"].dram_used)

        sampler = threading.Thread(target=sample)
        writers = [threading.Thread(target=write, args=(a_keys, "a", 1)),
                   threading.Thread(target=write, args=(b_keys, "b", 2))]
        sampler.start()
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        done.set()
        sampler.join()
        assert not errors, errors

        with cluster.client() as c:
            rows = {t.tenant: t for t in c.stats().tenants}
            assert samples and max(samples) <= QUOTA
            assert rows["a"].dram_used <= QUOTA and rows["a"].dram_quota == QUOTA
            assert rows["a"].evictions >= len(a_keys) - QUOTA // SIZE
            assert rows["b"].evictions == 0
            assert rows["b"].dram_used == len(b_keys) * SIZE
            # B's objects were never evicted by A: every one reads back intact.
            for i, key in enumerate(b_keys):
                assert bytes(c.get(key)) == blob(2, i)
            # A keeps its newest objects (its oldest went first).
            assert bytes(c.get(a_keys[-1])) == blob(1, len(a_keys) - 1)
            found = c.exists(a_keys)
            assert sum(found) <= QUOTA // SIZE and not found[0]

            with pytest.raises(QuotaExceeded, match="larger than its DRAM quota") as info:
                c.put("a-huge", bytes(QUOTA + SIZE), tenant="a")
            assert isinstance(info.value, NoSpace)

        assert cluster.master is not None
        text = cluster.master.metrics()
        used = metric_value(text, "mooncake_store_tenant_used_bytes",
                            'tenant="a",tier="dram"')
        assert 0 < used <= QUOTA
        assert metric_value(text, "mooncake_store_tenant_refusals_total", 'tenant="a"') >= 1
