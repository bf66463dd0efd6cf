"""SGLang HiCache L3 storage backend over our KV pool.

SGLang keeps KV in three tiers: the device pool (L1), a host-memory pool (L2) and a storage
backend (L3) that other SGLang processes share. This class is that L3, loaded by SGLang's
`dynamic` backend (`--hicache-storage-backend dynamic`, `interface_v1`): pages move between
SGLang's host pool and our store without an intermediate tensor (`batch_get_v1`/`batch_set_v1`
get the page's memory regions from `mem_pool_host.get_page_buffer_meta` and hand them to a
`PagePool`: in-process store client, or the pod's transfer sidecar over its Unix socket).

Keys: SGLang's page key is a SHA-256 chain over the page's token ids, seeded per tenant by the
request's `cache_salt` (the worker sets it from our tenant). We prefix it with our namespace
(model fingerprint, dtype, page size, and a kv_layout tag naming SGLang, its host layout and TP
size: what makes two pages the same KV) and the rank, so two deployments or two TP shapes never
read each other's pages. The Conductor computes the same names (`common.blocks.block_keys`), so
its index sees SGLang's pool pages like any block. Every page read is verified by the pool
(size and checksum); a page that fails is a miss, and SGLang recomputes it: a bad page costs
time, never output.

Not layer-wise (issue 20 item 3; docs/engines.md): SGLang hands this backend whole pages
(every layer) from its backup thread, after the device-to-host write-through of a radix node
that a forward pass already computed (`write_backup_storage` -> `write_storage` ->
`batch_set_v1`), and reads whole pages into its host pool. The interface names pages, never
layers, so there is no seam to write a layer while the next one computes; SGLang's own
host-to-device load is the per-layer step (`LayerDoneCounter`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from mooncake_k8s.engine.statsfile import stats_path, write_stats

log = logging.getLogger(__name__)


def open_pool(extra: dict[str, Any]) -> Any:
    """The pool the config names: the sidecar's socket when given, else our store directly."""
    if extra.get("sidecar"):
        from mooncake_k8s.sidecar.client import SidecarPagePool

        return SidecarPagePool(str(extra["sidecar"]))
    from mooncake_k8s.store.client.pagepool import DirectPagePool

    return DirectPagePool(str(extra["master"]), os.environ.get("MOONCAKE_CLUSTER_TOKEN", ""),
                          transport=str(extra.get("transport", "auto")))


class MooncakeK8sHiCache(HiCacheStorage):  # type: ignore[misc]
    """See the module docstring. Constructed by SGLang as `cls(storage_config, kwargs)`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        prefix = str(extra.get("key_prefix") or "")
        if not prefix.startswith("sg/"):
            raise ValueError("the mooncake_k8s HiCache backend needs the 'key_prefix' the "
                             "worker computes (common.blocks.sglang_key_prefix)")
        # Rank 0's keys are exactly the Conductor's (common.blocks); other ranks hold other
        # heads or layers of the same pages (the TP size is part of the namespace).
        rank = storage_config.tp_rank + storage_config.tp_size * storage_config.pp_rank
        self._prefix = prefix if rank == 0 else f"{prefix}r{rank}/"
        self._writer = storage_config.is_storage_writer
        self._pool = open_pool(extra)
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._stats = {"exists_queries": 0, "exists_hits": 0, "pages_loaded": 0,
                       "pages_missed": 0, "pages_saved": 0, "save_failed": 0}
        self._stats_file = stats_path(extra.get("stats_prefix"), "hicache")

    # -- stats (the worker sums the files of SGLang's processes, as for vLLM) ---------------

    def _count(self, **inc: int) -> None:
        """Add to the counters and rewrite the stats file (once per batch call: cheap next to
        the pages it moved, and never stale when the worker reads it)."""
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v
            write_stats(self._stats_file, self._stats)

    # -- keys and memory ---------------------------------------------------------------------

    def _keys(self, keys: list[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _pages(self, n: int, host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n if n else 0
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per],
                         strict=True)) for i in range(n)]

    # -- the v1 interface SGLang calls ---------------------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            n = int(self._pool.prefix_exists(self._keys(keys))) if keys else 0
        except ConnectionError as e:  # the pool is down: nothing is there, SGLang computes
            log.warning("KV pool unavailable, treating pages as missing: %s", e)
            n = 0
        self._count(exists_queries=len(keys), exists_hits=n)
        return n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        try:
            ok = [bool(x) for x in self._pool.get_pages(self._keys(keys),
                                                       self._pages(len(keys), host_indices))]
        except ConnectionError as e:
            log.warning("KV pool unavailable, recomputing %d pages: %s", len(keys), e)
            ok = [False] * len(keys)
        loaded = sum(ok)
        self._count(pages_loaded=loaded, pages_missed=len(ok) - loaded)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self._writer:  # MLA: one rank writes what all ranks hold
            return [True] * len(keys)
        try:
            ok = [bool(x) for x in self._pool.put_pages(self._keys(keys),
                                                       self._pages(len(keys), host_indices))]
        except ConnectionError as e:
            log.warning("KV pool unavailable, %d pages not saved: %s", len(keys), e)
            ok = [False] * len(keys)
        saved = sum(ok)
        self._count(pages_saved=saved, save_failed=len(ok) - saved)
        return ok

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the tensor interface (used only without interface_v1, which the worker always sets) --

    def _no_v0(self) -> Any:
        raise NotImplementedError("the mooncake_k8s backend speaks HiCache interface_v1 only: "
                                  "set \"interface_v1\": 1 in its extra config")

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self._no_v0()

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        return self._no_v0()

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return bool(self._no_v0())

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return bool(self._no_v0())

    def clear(self) -> None:
        """SGLang's `/flush_cache` clears L1/L2; the shared pool is not ours to wipe from one
        worker (the store's eviction and `mooncake store` tools manage it)."""

    def get_stats(self) -> Any:
        """None: SGLang then reports its own storage metrics (prefetched and backed-up pages,
        bandwidth); ours go to the worker through the stats file."""
        return None

    def close(self) -> None:
        self._pool.close()
