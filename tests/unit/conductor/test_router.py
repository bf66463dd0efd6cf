"""The live router turns the instances' load reports into one decision and one plan.

Instances here are the Conductor's real `Instance` records with load reports as workers send
them (the router makes no call: their channels are never used). What is checked is what the
workers receive: the pair, and the `KVPlan` both of them get.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mooncake_k8s.common.blocks import block_keys
from mooncake_k8s.common.netutil import local_host_id
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.sched.admission import (
    SLO,
    AdmissionConfig,
    DecodeLedger,
    Overloaded,
)
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.bookings import DecodeBookings
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.conductor.serving.router import (
    MooncakeRouter,
    Route,
    RouteRequest,
    namespace_of,
    with_pairing,
)
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import StoreCluster, store_cluster

TOKENS = list(range(1, 41))


def _inst(role: str, name: str, revision: str, fingerprint: str = "ab" * 16,
          block_tokens: int = 8, **report: object) -> Instance:
    rep = pb.LoadReport(instance_id=name, role=role, revision=revision, model="m",
                        model_fingerprint=fingerprint, dtype="bfloat16",
                        block_tokens=block_tokens, max_context=2048, ready=True,
                        **report)  # type: ignore[arg-type]
    return Instance(f"{name}:1", role, grpc.aio.insecure_channel("127.0.0.1:1"), rep, True)


def _route(router: MooncakeRouter, prefills: list[Instance], decodes: list[Instance],
           **req: object) -> Route:
    return asyncio.run(router.route(
        RouteRequest("r1", TOKENS, "t", 8, **req), prefills, decodes))  # type: ignore[arg-type]


def _router(admission: AdmissionConfig | None = None) -> MooncakeRouter:
    return MooncakeRouter(Scheduler(SchedulerConfig(policy="load_balancing",
                                                    admission=admission),
                                    load(BUILTIN_CPU_PROFILE), KVIndex()))


def test_during_a_rollout_the_pair_and_the_plan_are_of_one_revision() -> None:
    async def instances() -> tuple[list[Instance], list[Instance]]:
        # The new revision's prefill (another model, idle) has no decode partner yet.
        new = _inst("prefill", "p-new", "v2", fingerprint="cd" * 16, block_tokens=4)
        old = _inst("prefill", "p-old", "v1", queued_requests=3, queued_tokens=900)
        busy = _inst("decode", "d-new", "v3", running=0)
        mine = _inst("decode", "d-old", "v1", running=5, local_segment="seg-d-old")
        return [new, old], [busy, mine]

    prefills, decodes = asyncio.run(instances())
    route = _route(_router(), prefills, decodes)
    assert (route.prefill.instance_id, route.decode.instance_id) == ("p-old", "d-old")
    ns = namespace_of(prefills[1], "t")
    plan = route.plan
    assert plan.planned and plan.namespace == ns.digest().hex()
    assert len(plan.block_keys) == len(TOKENS) // 8  # the keyed prefill's block size
    assert plan.write_segment == "seg-d-old"


def test_a_resume_is_routed_where_a_new_request_is_shed() -> None:
    async def instances() -> tuple[list[Instance], list[Instance]]:
        return ([_inst("prefill", "p0", "v1", queued_requests=50, queued_tokens=90_000)],
                [_inst("decode", "d0", "v1")])

    prefills, decodes = asyncio.run(instances())
    router = _router(AdmissionConfig(SLO(ttft_ms=50.0)))
    with pytest.raises(Overloaded):
        _route(router, prefills, decodes)
    route = _route(router, prefills, decodes, shed=False)
    assert route.decode.instance_id == "d0" and route.plan.planned


def test_pairing_copies_the_plan() -> None:
    plan = pb.KVPlan(block_keys=["a" * 32], namespace="ns", planned=True)
    paired = with_pairing(plan, "127.0.0.1:7", 9)
    assert (paired.bootstrap_addr, paired.bootstrap_room) == ("127.0.0.1:7", 9)
    assert paired.block_keys == plan.block_keys and not plan.bootstrap_addr


# -- locality per host, learnt from a real store ---------------------------------------------

HERE = local_host_id()


def _far_node(cluster: StoreCluster, node_id: str, host_id: str) -> StorageNode:
    """A storage node in this process that says it is on another host (the store trusts a
    node's host id; on loopback that is the only way to have two hosts)."""
    node = StorageNode(NodeConfig(master=cluster.master_address, node_id=node_id,
                                  token=cluster.token, dram_size=8 << 20, host_id=host_id))
    node.start()
    assert node.wait_registered(30)
    return node


def _hold(router: MooncakeRouter, inst: Instance, segment: str) -> int:
    """The prompt's full blocks, as the store's events would put them in `segment`."""
    keys = block_keys(namespace_of(inst, "t"), TOKENS)
    bit = router.index.segment(segment)
    for k in keys:
        router.index.add(k, bit)
    return len(keys)


def test_an_instances_local_kv_is_every_segment_on_its_host() -> None:
    with store_cluster(nodes=0, dram_size="8MiB") as cluster:
        cluster.start_node("n0", "8MiB")  # this host
        far = _far_node(cluster, "far", "host-far")
        try:
            with cluster.client() as store:
                _check_host_masks(store)
        finally:
            far.stop()


def _check_host_masks(store: StoreClient) -> None:
    router = MooncakeRouter(Scheduler(SchedulerConfig(policy="global_cache_aware"),
                                      load(BUILTIN_CPU_PROFILE), KVIndex()), store)

    async def run() -> None:
        here = _inst("prefill", "p-here", "v1", host_id=HERE, local_segment="p-here-seg")
        there = _inst("prefill", "p-far", "v1", host_id="host-far", local_segment="p-far-seg")
        d_here = _inst("decode", "d-here", "v1", host_id=HERE, local_segment="n0-dram-0")
        d_far = _inst("decode", "d-far", "v1", host_id="host-far", local_segment="far-dram-0")
        own = router.index.mask(["p-here-seg"])
        assert router.local_mask(HERE, "p-here-seg") == own  # nothing known yet: its own
        n = _hold(router, here, "n0-dram-0")  # the prefix is on this host, in n0's segment
        route = await router.route(RouteRequest("r1", TOKENS, "t", 8), [there, here],
                                   [d_far, d_here])
        assert router._refresh is not None  # the first decision asked the store (a thread)
        await router.refresh_hosts()
        assert {h: sorted(s) for h, s in router.hosts.items()} == {
            HERE: ["n0-dram-0"], "host-far": ["far-dram-0"]}
        assert router.local_mask(HERE, "p-here-seg") == own | router.index.mask(["n0-dram-0"])
        router.scheduler.ledger = DecodeLedger()  # r1's load forgotten: equal loads again
        router.bookings = DecodeBookings()
        route = await router.route(RouteRequest("r2", TOKENS, "t", 8), [there, here],
                                   [d_far, d_here])
        assert (route.prefill.instance_id, route.decode.instance_id) == ("p-here", "d-here")
        plan = route.plan
        assert (plan.local_blocks, plan.fetch_blocks, plan.keep_fetched) == (n, 0, False)
        assert (plan.home_segment, plan.write_segment) == ("p-here-seg", "n0-dram-0")
        # Held only on the far host, whose prefill is busy: this host's prefill fetches it and
        # keeps what it read (a repeat then stays on this host).
        router.index.clear()
        router.scheduler.ledger = DecodeLedger()
        router.bookings = DecodeBookings()
        _hold(router, here, "far-dram-0")
        busy = _inst("prefill", "p-far", "v1", host_id="host-far", local_segment="p-far-seg",
                     queued_requests=4, queued_tokens=4000)
        route = await router.route(RouteRequest("r3", TOKENS, "t", 8), [busy, here],
                                   [d_far, d_here])
        plan = route.plan
        assert route.prefill.instance_id == "p-here"
        assert (plan.local_blocks, plan.fetch_blocks, plan.keep_fetched) == (0, n, True)
        assert plan.home_segment == "p-here-seg"
        assert route.decode.instance_id == "d-far"  # the decode whose host holds the prefix

    asyncio.run(run())


def test_a_call_that_ended_since_the_last_poll_no_longer_loads_its_instance() -> None:
    """A decode that has just streamed a prompt still reports it running until its next poll;
    the Conductor, which saw the stream end, does not count it, so the next request with that
    prefix goes to the decode holding it instead of one that must fetch it over the network."""
    router = MooncakeRouter(Scheduler(SchedulerConfig(policy="global_cache_aware"),
                                      load(BUILTIN_CPU_PROFILE), KVIndex()))
    p0 = _bare("prefill", "p0", local_segment="seg-p0")
    d0 = _bare("decode", "d0", local_segment="seg-d0", kv_capacity_tokens=10_000,
               kv_free_tokens=10_000)
    d1 = _bare("decode", "d1", local_segment="seg-d1", kv_capacity_tokens=10_000,
               kv_free_tokens=6_000, running=1)
    _hold(router, p0, "seg-p0")
    _hold(router, d1, "seg-d1")
    assert _route(router, [p0], [d0, d1]).decode is d0  # the stale report makes d1 look busy
    d1.note_done(4_000)
    assert d1.since_report() == (1, 4_000)
    assert _route(router, [p0], [d0, d1]).decode is d1


def _bare(role: str, name: str, **report: object) -> Instance:
    """An instance with a report and no channel (routing never calls it)."""
    rep = pb.LoadReport(instance_id=name, role=role, revision="r", model="m",
                        model_fingerprint="ab" * 16, dtype="bfloat16", block_tokens=8,
                        max_context=2048, ready=True, **report)  # type: ignore[arg-type]
    return Instance(f"{name}:1", role, None, rep, True)  # type: ignore[arg-type]
