"""The live router: the scheduler's decision over the instance pools, as a typed plan.

`MooncakeRouter` builds the scheduler's views (`sched.scheduler.PrefillView`, `DecodeView`)
from the instances' load reports (revision included), computes the prompt's block keys once in
the workers' namespace, asks `Scheduler.decide` (pure, no I/O; the one place the pair is
chosen) and returns a `Route`: the pair and the `KVPlan` message that prefill and decode both
receive as it is. It is the one place where the scheduler meets I/O: the store (which host
each segment is on) and the Conductor's metrics.

Locality is per host: an instance's local mask is every segment on the host its load report
names (`LoadReport.host_id`), learnt from the store's segment list (`StoreClient.segments`),
read off the event loop every `hosts_refresh_s` and whenever the KV index meets a segment it
has not seen; until then (or when a report names no host) it is the instance's own segment.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched.admission import Overloaded
from mooncake_k8s.conductor.sched.blocktable import BlockKeys
from mooncake_k8s.conductor.sched.scheduler import (
    DecodeView,
    Demand,
    Policy,
    PrefillView,
    Scheduler,
    paired,
)
from mooncake_k8s.conductor.serving.bookings import DecodeBookings
from mooncake_k8s.conductor.serving.errors import NoCapacity
from mooncake_k8s.conductor.serving.instances import Instance

if TYPE_CHECKING:
    from mooncake_k8s.store.client import StoreClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    token_ids: Sequence[int]
    tenant: str
    max_tokens: int
    use_prefix_cache: bool = True
    priority: str = "interactive"
    """Request class for early rejection (`interactive` is shed last)."""
    shed: bool = True
    """False for a resumed stream: the client is already reading it, so it is never refused
    (`Scheduler.decide(shed=False)`)."""


@dataclass(frozen=True)
class Route:
    """The decision for one attempt: the pair and the plan both workers receive unchanged."""

    prefill: Instance
    decode: Instance
    plan: pb.KVPlan
    """The `KVPlan` message, made once here; `Pipeline` sends it as it is to prefill and to
    decode (paired handoff adds the meeting point to a copy, `with_pairing`)."""


def with_pairing(plan: pb.KVPlan, addr: str, room: int) -> pb.KVPlan:
    """A copy of `plan` naming the paired handoff's meeting point (SGLang PD): one room per
    attempt, so the route's own plan is never changed."""
    out = pb.KVPlan()
    out.CopyFrom(plan)
    out.bootstrap_addr, out.bootstrap_room = addr, room
    return out


class Router(Protocol):
    async def route(
        self, req: RouteRequest, prefills: Sequence[Instance], decodes: Sequence[Instance]
    ) -> Route: ...


def _address(inst: Instance) -> str:
    return inst.address


def request_seed(token_ids: Sequence[int]) -> int:
    """A number from the prompt alone (not Python's per-process `hash`): what the random
    policy draws from, so every Conductor replica draws the same for the same request."""
    return zlib.crc32(array("q", token_ids).tobytes())


def namespace_of(inst: Instance, tenant: str) -> KeyNamespace:
    """The key namespace an instance's engine uses; equal for instances of one model."""
    r = inst.report
    assert r is not None
    return KeyNamespace(model_fingerprint=r.model_fingerprint, dtype=r.dtype,
                        block_tokens=r.block_tokens, tenant_salt=tenant,
                        kv_layout=r.kv_layout)


class MooncakeRouter:
    """The live Conductor's `Router`: `Scheduler.decide` over the instance pools.

    Views come from the instances' load reports plus what this Conductor has sent since
    (`inflight`): a prefill queue is predicted from its queued tokens with the cost model
    (their cached share is unknown here, so it is an upper bound); a decode instance's load is
    the larger of its report and the ledger. Block keys use the workers' namespace, so the
    index answers in the store's own keys. A predicted SLO miss raises `Overloaded` (429).

    The plan places the copies (design: KV placed by host): new blocks go to the decode
    instance's segment (`write_segment`) and to the prefill instance's own (`home_segment`),
    and a fetched prefix is kept where it was read (`keep_fetched`, the scheduler's
    `replicate`). Fetched prefixes are no longer soft-pinned: they are now really replicated
    by the workers within the pool's watermarks, and a pin (never released) only kept every
    copy of them from ever being evicted.
    """

    def __init__(self, scheduler: Scheduler, store: StoreClient | None = None,
                 metrics: ConductorMetrics | None = None, *,
                 hosts_refresh_s: float = 10.0) -> None:
        self.scheduler = scheduler
        self.index = scheduler.index
        self.store = store
        self.metrics = metrics
        self.hosts_refresh_s = hosts_refresh_s
        self._slots: dict[str, int] = {}
        self._on_host: dict[str, list[str]] = {}
        """Host id -> the names of the segments on it (from the store)."""
        self._masks: dict[tuple[str, str], int] = {}
        """(host id, local segment) -> local mask; emptied when the hosts change."""
        self._hosts_at = -math.inf
        self._hosts_seen = 0
        """Segments the index had when the last refresh began."""
        self._refresh: asyncio.Future[None] | None = None
        self._hosts_failing = False
        """The last read failed (the next failures are logged at debug level only)."""
        self.bookings = DecodeBookings()
        self._seeded = self.scheduler.config.policy == Policy.RANDOM
        """The random policy draws from the request (`request_seed`): replicas agree."""

    def _slot(self, inst: Instance) -> int:
        slot = self._slots.get(inst.address)
        if slot is None:
            slot = self._slots[inst.address] = len(self._slots)
        return slot

    # -- which host each segment is on ----------------------------------------------------

    def set_hosts(self, segments: Iterable[tuple[str, str]]) -> None:
        """(segment name, host id) pairs: the store's segments, all of them."""
        on_host: dict[str, list[str]] = {}
        for name, host in segments:
            if host:
                on_host.setdefault(host, []).append(name)
        if on_host != self._on_host:
            self._on_host = on_host
            self._masks.clear()

    @property
    def hosts(self) -> Mapping[str, Sequence[str]]:
        """Host id -> its segments, as last read from the store."""
        return self._on_host

    def refresh_hosts(self) -> asyncio.Future[None]:
        """Read the store's segment list in a thread (a refresh under way is joined); the
        views use the answer from the next decision on. A failed read keeps the old map."""
        if self._refresh is not None and not self._refresh.done():
            return self._refresh
        loop = asyncio.get_running_loop()
        self._hosts_at = time.monotonic()
        self._hosts_seen = len(self.index.segment_names)
        store = self.store

        def read() -> list[tuple[str, str]]:
            assert store is not None
            return [(s.name, s.host_id) for s in store.segments()]

        done: asyncio.Future[None] = loop.create_future()

        def finish(f: asyncio.Future[list[tuple[str, str]]]) -> None:
            try:
                self.set_hosts(f.result())
                self._hosts_failing = False
            except Exception as e:  # a stale map costs locality, never a request
                (log.debug if self._hosts_failing else log.warning)(
                    "reading the store's segments failed; keeping the host map",
                    extra={"error": f"{type(e).__name__}: {e}"})
                self._hosts_failing = True
            done.set_result(None)

        loop.run_in_executor(None, read).add_done_callback(finish)
        self._refresh = done
        return done

    def _maybe_refresh(self) -> None:
        if self.store is None:
            return
        if (time.monotonic() - self._hosts_at >= self.hosts_refresh_s
                or len(self.index.segment_names) > self._hosts_seen):
            self.refresh_hosts()

    def local_mask(self, host_id: str, segment: str) -> int:
        """The KV index mask of every segment on `host_id`, and `segment` (the instance's
        own, which is on its host whatever the map says)."""
        key = (host_id, segment)
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = self.index.mask([*self._on_host.get(host_id, ()), segment])
        return m

    # -- views and the decision -----------------------------------------------------------

    def _prefill_view(self, inst: Instance) -> PrefillView:
        """A prefill group is seen through its leader: its queue drains at the group's rate
        and its local KV is the leader's host (where the plan's `home_segment` is)."""
        r = inst.report
        group = inst.group_size
        pf = self.scheduler.model.prefill_for(group)
        done, done_tokens = inst.since_report()
        queued = max((r.queued_tokens if r else 0) - done_tokens, inst.inflight_tokens)
        jobs = max((r.queued_requests if r else 0) - done, inst.inflight)
        mask = self.local_mask(r.host_id, r.local_segment) if r else 0
        return PrefillView(self._slot(inst), pf.queue_ms(jobs, queued), mask,
                           r.revision if r else "", group)

    def _decode_view(self, inst: Instance) -> DecodeView:
        """The report (everyone's streams as of the poll) plus this Conductor's bookings it
        does not count yet (`bookings`: what bounds the over-commit between replicas)."""
        r = inst.report
        if r is None:
            return DecodeView(self._slot(inst), inst.inflight)
        done, done_tokens = inst.since_report()
        seqs, toks = self.bookings.pending(inst.address, r)
        used = max(0, r.kv_capacity_tokens - r.kv_free_tokens - done_tokens) + toks
        return DecodeView(self._slot(inst), max(max(0, r.running - done) + seqs, inst.inflight),
                          used, r.kv_capacity_tokens, r.revision,
                          self.local_mask(r.host_id, r.local_segment))

    async def route(self, req: RouteRequest, prefills: Sequence[Instance],
                    decodes: Sequence[Instance]) -> Route:
        # A prefill group's later stage, or a leader whose group is not whole, is never a
        # target, whoever passed it (the pools' `usable` leave them out already).
        # In address order: ties go to the first candidate, so replicas that see the same
        # instances and reports choose the same, whatever order they discovered them in.
        prefills = sorted((p for p in prefills if not p.not_target), key=_address)
        decodes = sorted(decodes, key=_address)
        if not prefills:
            raise NoCapacity("no prefill instance is ready")
        if not decodes:
            raise NoCapacity("no decode instance is ready")
        pviews = [self._prefill_view(p) for p in prefills]
        dviews = [self._decode_view(d) for d in decodes]
        self._maybe_refresh()
        # The keys are in the namespace of a prefill instance the scheduler can pair (during
        # a rollout another revision may be another model); they travel in the plan.
        keyed = next((p for p, v in zip(prefills, pviews, strict=True)
                      if paired(v.revision, dviews)), prefills[0])
        assert keyed.report is not None
        ns = namespace_of(keyed, req.tenant)
        # Once per request, decoded for the index here too, with the hashing (BlockKeys), so
        # the decision starts from integers.
        keys = BlockKeys(block_keys(ns, req.token_ids))
        demand = Demand(keys if req.use_prefix_cache else [], len(req.token_ids),
                        max(1, req.max_tokens), req.priority, keyed.report.block_tokens,
                        seed=request_seed(req.token_ids) if self._seeded else 0)
        dec = self.scheduler.decide(demand, pviews, dviews, time.monotonic() * 1000.0,
                                    shed=req.shed)
        if self.metrics is not None and math.isfinite(dec.verdict.headroom_ms):
            self.metrics.ttft_headroom.set(dec.verdict.headroom_ms)
        if not dec.admitted:
            if self.metrics is not None:
                self.metrics.rejections.labels(f"slo_{dec.verdict.reason}").inc()
            raise Overloaded(dec.verdict, demand.priority)
        prefill, decode = prefills[dec.prefill], decodes[dec.decode]
        self.bookings.book(decode.address, len(req.token_ids) + demand.max_tokens,
                           decode.report)
        plan = pb.KVPlan(block_keys=keys, namespace=ns.digest().hex(),
                         local_blocks=dec.local_blocks, fetch_blocks=dec.fetch_blocks,
                         write_segment=decode.report.local_segment if decode.report else "",
                         home_segment=prefill.report.local_segment if prefill.report else "",
                         keep_fetched=dec.replicate, planned=True)
        return Route(prefill, decode, plan)
