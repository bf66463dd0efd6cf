"""Choosing the (prefill, decode) pair for a request.

The policy sits behind `Router` so the full Mooncake scheduler (cost model, early rejection)
replaces this one without touching the API or the request pipeline. This first policy:
- prefill: the instance with the longest cached prefix available to it, ties broken by load
  (queued prompt tokens, including what this Conductor sent since the last report). The store is
  asked once, in one batched call, how many leading blocks exist;
- decode: the least loaded instance with room for the request's KV, preferring one of the
  prefill instance's revision (during a rollout, old and new versions never pair).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.errors import MooncakeError, StoreError
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.instances import Instance
from mooncake_k8s.store.client import StoreClient


class NoCapacity(MooncakeError):
    """No usable instance of a role (all down, draining or still loading)."""


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    token_ids: Sequence[int]
    tenant: str
    max_tokens: int
    use_prefix_cache: bool = True
    priority: str = "interactive"
    """Request class for early rejection (`interactive` is shed last)."""


@dataclass(frozen=True)
class Route:
    prefill: Instance
    decode: Instance
    cached_blocks: int
    """Leading blocks the store holds for this prompt when the route was chosen."""
    keys: tuple[str, ...] = ()
    """The prompt's full-block keys in the prefill engine's namespace (computed once, here)."""
    namespace: str = ""
    """Hex digest of that namespace; workers in another one recompute instead of trusting."""
    local_blocks: int = 0
    """Of `cached_blocks`, those the prefill instance holds itself (the rest it fetches)."""

    def plan(self) -> pb.KVPlan:
        """The decision as the prefill worker receives it."""
        seg = self.decode.report.local_segment if self.decode.report else ""
        local = min(self.local_blocks, self.cached_blocks)
        return pb.KVPlan(block_keys=self.keys, namespace=self.namespace, local_blocks=local,
                         fetch_blocks=self.cached_blocks - local, write_segment=seg,
                         planned=bool(self.namespace))


class Router(Protocol):
    async def route(
        self, req: RouteRequest, prefills: Sequence[Instance], decodes: Sequence[Instance]
    ) -> Route: ...


def namespace_of(inst: Instance, tenant: str) -> KeyNamespace:
    """The key namespace an instance's engine uses; equal for instances of one model."""
    r = inst.report
    assert r is not None
    return KeyNamespace(model_fingerprint=r.model_fingerprint, dtype=r.dtype,
                        block_tokens=r.block_tokens, tenant_salt=tenant,
                        kv_layout=r.kv_layout)


class PrefixAwareRouter:
    def __init__(self, store: StoreClient | None) -> None:
        self.store = store

    async def cached_blocks(self, req: RouteRequest, keys: list[str]) -> int:
        if self.store is None or not req.use_prefix_cache or not keys:
            return 0
        try:
            return await asyncio.to_thread(self.store.prefix_len, keys)
        except StoreError:
            return 0  # the store being down costs cache hits, not availability

    async def route(
        self, req: RouteRequest, prefills: Sequence[Instance], decodes: Sequence[Instance]
    ) -> Route:
        if not prefills:
            raise NoCapacity("no prefill instance is ready")
        if not decodes:
            raise NoCapacity("no decode instance is ready")
        # One store, one namespace per model: every prefill instance sees the same prefix, so
        # one lookup serves them all. (Instance-local caches are the scheduler issue's job.)
        prefill = min(prefills, key=_prefill_load)
        ns = namespace_of(prefill, req.tenant)
        keys = block_keys(ns, req.token_ids)
        cached = await self.cached_blocks(req, keys)
        decode = pick_decode(decodes, prefill, len(req.token_ids) + req.max_tokens)
        return Route(prefill, decode, cached, tuple(keys), ns.digest().hex())


def _prefill_load(inst: Instance) -> tuple[int, str]:
    r = inst.report
    queued = r.queued_tokens if r else 0
    return queued + inst.inflight_tokens, inst.address


def pick_decode(decodes: Sequence[Instance], prefill: Instance, need_tokens: int) -> Instance:
    rev = prefill.report.revision if prefill.report else ""
    same = [d for d in decodes if d.report and d.report.revision == rev] or list(decodes)

    def key(d: Instance) -> tuple[bool, int, str]:
        r = d.report
        assert r is not None
        no_room = r.kv_capacity_tokens > 0 and r.kv_free_tokens < need_tokens
        return no_room, r.running + d.inflight, d.address

    return min(same, key=key)
