"""Prefill groups (chunked pipeline-parallel prefill) as the Conductor sees them: one target.

Instances are the Conductor's real `Instance` records in real pools, with load reports as a
group's stages send them (`LoadReport.pipeline_*`); the scheduler, router and pipeline are the
real ones (no call reaches a worker: the routing rules are what is checked). What is checked:
a later stage is never a target; a leader is one only while its group is whole (its own word
and every stage this Conductor polls answering); a group is costed with its own cost-model
entry; its local KV is its leader's host; a group that failed a request is not tried again
for it, and the reroute says it was a group.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from prometheus_client import generate_latest

from mooncake_k8s.common.blocks import block_keys
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched.costmodel import (
    BUILTIN_CPU_PROFILE,
    PIPELINE_MIN_CHUNK,
    Prefill,
    load,
    pipelined,
)
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import (
    DecodeView,
    Demand,
    PrefillView,
    Scheduler,
    SchedulerConfig,
)
from mooncake_k8s.conductor.serving import pipeline as pl
from mooncake_k8s.conductor.serving.errors import NoCapacity
from mooncake_k8s.conductor.serving.instances import Instance, InstancePool
from mooncake_k8s.conductor.serving.pipeline import Generation, Pipeline
from mooncake_k8s.conductor.serving.router import MooncakeRouter, RouteRequest, namespace_of
from mooncake_k8s.store.testing import metric_value

BT = 64
LONG = list(range(1, 3073))  # 3K tokens: a group's reason to be
SHORT = list(range(1, 41))


def _inst(name: str, role: str = "prefill", *, group: str = "", stage: int = 0,
          size: int = 1, whole: bool = False, healthy: bool = True,
          **report: object) -> Instance:
    rep = pb.LoadReport(instance_id=name, role=role, revision="v1", model="m",
                        model_fingerprint="ab" * 16, dtype="float32", block_tokens=BT,
                        max_context=8192, ready=True, pipeline_group=group,
                        pipeline_stage=stage, pipeline_group_size=size, pipeline_whole=whole,
                        **report)  # type: ignore[arg-type]
    return Instance(f"{name}:1", role, grpc.aio.insecure_channel("127.0.0.1:1"), rep, healthy)


def _group(name: str, whole: bool = True, tag: str = "",
           **leader: int) -> tuple[Instance, Instance]:
    """A group of two: (leader, stage 1), on two hosts; `tag` tells instances apart."""
    return (_inst(f"{name}{tag}-0", group=name, stage=0, size=2, whole=whole,
                  host_id=f"{name}-host0", local_segment=f"{name}-seg0",
                  **leader),  # type: ignore[arg-type]
            _inst(f"{name}{tag}-1", group=name, stage=1, size=2, whole=whole,
                  host_id=f"{name}-host1", local_segment=f"{name}-seg1"))


def _pool(role: str, *insts: Instance) -> InstancePool:
    pool = InstancePool(role, "", "")
    for i in insts:
        pool.instances[i.address] = i
    pool.groups()  # as after a poll
    return pool


def _router(model_name: str = BUILTIN_CPU_PROFILE, policy: str = "global_cache_aware",
            **groups: Prefill) -> MooncakeRouter:
    model = load(model_name)
    if groups:
        model = dataclasses.replace(model, prefill_groups={int(g[1:]): pf
                                                           for g, pf in groups.items()})
    return MooncakeRouter(Scheduler(SchedulerConfig(policy=policy, block_tokens=BT), model,
                                    KVIndex()))


def _route(router: MooncakeRouter, prefills: list[Instance], decodes: list[Instance],
           tokens: list[int] = LONG) -> tuple[str, pb.KVPlan]:
    r = asyncio.run(router.route(RouteRequest("r", tokens, "t", 4), prefills, decodes))
    return r.prefill.instance_id, r.plan


# -- which instances are targets ------------------------------------------------------------


def test_a_later_stage_is_listed_never_a_target_and_a_whole_groups_leader_is_one() -> None:
    async def main() -> None:
        leader, stage = _group("g0")
        single = _inst("p0")
        pool = _pool("prefill", leader, stage, single)
        assert pool.usable() == [leader, single]
        assert (leader.state, stage.state, single.state) == ("ready", "stage", "ready")
        assert (leader.group_size, stage.group_size, single.group_size) == (2, 2, 1)
        # A stage is nowhere a call could go either (a lost instance's calls are abandoned
        # only while another answers).
        assert not stage.answering and leader.answering
        m = ConductorMetrics()
        m.observe_pools(pool.instances.values(), [])
        text = generate_latest(m.registry).decode()
        for state, n in (("ready", 2), ("stage", 1), ("incomplete", 0), ("unready", 0)):
            assert metric_value(text, "mooncake_conductor_instances",
                                f'role="prefill",state="{state}"') == n, state

    asyncio.run(main())


def test_a_group_that_is_not_whole_or_misses_a_stage_is_incomplete_until_whole() -> None:
    async def main() -> None:
        leader, stage = _group("g0", whole=False)  # the leader's own check failed
        pool = _pool("prefill", leader, stage)
        assert pool.usable() == [] and leader.state == "incomplete"
        assert leader.report is not None and stage.report is not None
        leader.report.pipeline_whole = True
        pool.groups()
        assert pool.usable() == [leader]
        # The leader still says whole, but a stage this Conductor polls stopped answering
        # (killed, partitioned): out of rotation at once, with the stage named.
        pool.mark_failed(stage, "UNAVAILABLE: connection refused")
        stage.unreachable = True
        pool.groups()
        assert pool.usable() == [] and leader.state == "incomplete"
        assert leader.group_broken == "stage 1 (g0-1) is not answering: UNAVAILABLE"
        assert stage.state == "unreachable"
        # Back when the stage answers again.
        stage.healthy, stage.unreachable, stage.last_error = True, False, ""
        pool.groups()
        assert pool.usable() == [leader] and leader.group_broken == ""
        # Polled stages listed, one of them gone from the listing (its pod deleted).
        leader3, stage3 = _group("g3")
        assert leader3.report is not None and stage3.report is not None
        stage3.report.pipeline_group_size = leader3.report.pipeline_group_size = 3
        pool3 = _pool("prefill", leader3, stage3)
        assert leader3.group_broken == "stage 2 of 3 is not among the instances"
        assert pool3.usable() == [] and leader3.state == "incomplete"
        # Another revision's group of the same name is another group.
        other, other_stage = _group("g0", tag="v2")
        assert other.report is not None and other_stage.report is not None
        other.report.revision = other_stage.report.revision = "v2"
        pool2 = _pool("prefill", leader, stage, other, other_stage)
        pool2.mark_failed(other_stage, "UNAVAILABLE")
        pool2.groups()
        assert pool2.usable() == [leader]

    asyncio.run(main())


def test_only_a_stage_and_an_incomplete_group_means_no_prefill_capacity() -> None:
    async def main() -> None:
        leader, stage = _group("g0", whole=False)
        pipe = Pipeline(_pool("prefill", leader, stage), _pool("decode", _inst("d0", "decode")),
                        _router(), retry_wait_s=0.0)
        gen = Generation("r", SHORT, "t", pb.Sampling(max_tokens=4))
        with pytest.raises(NoCapacity, match="no prefill instance is ready"):
            await pipe._route(gen, None, 0, "")

    asyncio.run(main())


# -- cost: the group's own entry --------------------------------------------------------------


def test_the_scheduler_costs_a_group_with_its_entry_and_else_the_estimate() -> None:
    base = load(BUILTIN_CPU_PROFILE)
    measured = Prefill(100.0, base.prefill.per_token_ms / 1.6, base.prefill.attn_ms / 1.6)
    model = dataclasses.replace(base, prefill_groups={2: measured})
    views = [PrefillView(0, 0.0, group_size=1), PrefillView(1, 0.0, group_size=2)]
    decodes = [DecodeView(0)]
    n = len(LONG)

    def decide(m: object, prefills: list[PrefillView]) -> tuple[int, float]:
        s = Scheduler(SchedulerConfig(block_tokens=BT), m, KVIndex())  # type: ignore[arg-type]
        d = s.decide(Demand([], n, 4), prefills, decodes, 0.0)
        return d.prefill, d.ttft_ms

    # Idle, the group's measured fit beats one instance on a long prompt.
    pi, ttft = decide(model, views)
    assert pi == 1 and ttft == pytest.approx(measured.ms(n))
    # The group alone is costed with its entry, not the single instance's fit.
    assert decide(model, views[1:])[1] == pytest.approx(measured.ms(n))
    # Without an entry: the documented estimate (per-token work / G, fill added to the base).
    est = pipelined(base.prefill, 2)
    assert decide(base, views[1:])[1] == pytest.approx(est.ms(n))
    assert base.prefill.ms(n) * 0.5 < est.ms(n) < base.prefill.ms(n)
    # A prompt of at most one pipeline chunk (the smallest is one compute chunk) gains
    # nothing from a group: an idle single instance is preferred (the estimate never
    # undercuts it there).
    for short in (len(SHORT), PIPELINE_MIN_CHUNK):
        assert est.ms(short) > base.prefill.ms(short)
        s = Scheduler(SchedulerConfig(block_tokens=BT), base, KVIndex())
        assert s.decide(Demand([], short, 4), views, decodes, 0.0).prefill == 0

    async def queued() -> None:
        # Queued work at the group drains at the group's rate too (the router's view).
        router = _router(g2=measured)
        leader, _ = _group("g0", queued_requests=2, queued_tokens=4000)
        view = router._prefill_view(leader)
        assert view.group_size == 2
        assert view.queue_ms == pytest.approx(2 * measured.base_ms
                                              + 4000 * measured.per_token_ms)

    asyncio.run(queued())


@pytest.mark.parametrize("policy", ["random", "round_robin", "load_balancing",
                                    "local_cache_aware", "global_cache_aware"])
def test_every_policy_predicts_a_groups_ttft_with_the_groups_fit(policy: str) -> None:
    model = dataclasses.replace(load(BUILTIN_CPU_PROFILE),
                                prefill_groups={2: Prefill(50.0, 0.5, 0.0)})
    s = Scheduler(SchedulerConfig(policy=policy, block_tokens=BT), model, KVIndex())
    d = s.decide(Demand([], 1000, 4), [PrefillView(0, 7.0, group_size=2)], [DecodeView(0)],
                 0.0)
    assert d.ttft_ms == pytest.approx(7.0 + 50.0 + 0.5 * 1000)


def test_the_router_picks_the_whole_group_for_a_long_prompt_never_its_stage() -> None:
    async def instances() -> tuple[list[Instance], list[Instance]]:
        leader, stage = _group("g0")
        return [stage, _inst("p0"), leader], [_inst("d0", "decode", local_segment="d0-seg")]

    prefills, decodes = asyncio.run(instances())
    router = _router()
    name, _ = _route(router, prefills, decodes)
    assert name == "g0-0"
    # A short one goes to the single instance (the group holds two hosts for it).
    assert _route(router, prefills, decodes, SHORT)[0] == "p0"


# -- locality: the group's KV is its leader's host -------------------------------------------


def test_a_groups_local_kv_is_its_leaders_host_and_the_plan_homes_there() -> None:
    async def instances() -> tuple[list[Instance], list[Instance]]:
        leader, stage = _group("g0")
        busy = _inst("p0", queued_requests=1, queued_tokens=64, host_id="h-p0",
                     local_segment="p0-seg")
        return [busy, leader, stage], [_inst("d0", "decode", local_segment="d0-seg")]

    prefills, decodes = asyncio.run(instances())
    router = _router()
    router.set_hosts([("g0-seg0", "g0-host0"), ("g0-node", "g0-host0"),
                      ("g0-seg1", "g0-host1"), ("p0-seg", "h-p0")])
    keys = block_keys(namespace_of(prefills[1], "t"), LONG)
    bit = router.index.segment("g0-node")  # a storage node on the leader's host
    for k in keys:
        router.index.add(k, bit)
    name, plan = _route(router, prefills, decodes)
    assert name == "g0-0"
    assert (plan.local_blocks, plan.fetch_blocks) == (len(keys), 0)
    assert (plan.home_segment, plan.write_segment) == ("g0-seg0", "d0-seg")
    # Held only on the stage's host: not the group's local KV (the leader reads it remotely).
    router.index.clear()
    bit = router.index.segment("g0-seg1")
    for k in keys:
        router.index.add(k, bit)
    router.scheduler.ledger.expire(1e18)
    _, plan = _route(router, prefills, decodes)
    assert plan.local_blocks == 0


# -- failover: a group that failed a request is not tried again for it --------------------


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


def test_a_failed_group_is_excluded_for_the_request_and_the_reroute_names_a_group() -> None:
    async def main() -> None:
        g0, g0s = _group("g0")
        g1, g1s = _group("g1")
        single = _inst("p0", queued_requests=50, queued_tokens=100_000)  # last resort
        prefills = _pool("prefill", g0, g0s, g1, g1s, single)
        metrics = ConductorMetrics()
        pipe = Pipeline(prefills, _pool("decode", _inst("d0", "decode")), _router(),
                        metrics=metrics, retry_wait_s=0.0)
        gen = Generation("r", LONG, "t", pb.Sampling(max_tokens=4))
        excluded: set[str] = set()
        seen = []
        for attempt in range(3):
            route = await pipe._route(gen, None, attempt, "x", excluded)
            seen.append(route.prefill.instance_id)
            if attempt == 2:
                break
            err = _rpc_error(grpc.StatusCode.UNAVAILABLE, "stage 1 stopped answering")
            pipe._fail(prefills, route.prefill, err)
            # The leader answers its next poll as ready before its own check notices.
            route.prefill.healthy = True
            pl._exclude(excluded, route.prefill)
        assert sorted(seen[:2]) == ["g0-0", "g1-0"] and seen[2] == "p0"
        text = generate_latest(metrics.registry).decode()
        assert metric_value(text, "mooncake_conductor_reroutes_total",
                            'cause="group_unavailable",role="prefill"') == 2
        assert 'cause="unavailable",role="prefill"' not in text
        # Nothing left but failed groups: a clear 503, not the same group again.
        pipe2 = Pipeline(_pool("prefill", g0, g0s), pipe.decodes, _router(), retry_wait_s=0.0)
        with pytest.raises(NoCapacity, match=r"other than the 1 group\(s\) that failed it"):
            await pipe2._route(gen, None, 1, "UNAVAILABLE", {g0.address})

    asyncio.run(main())


def test_a_request_can_ask_for_a_kind_of_target() -> None:
    async def main() -> None:
        g0, g0s = _group("g0")
        pipe = Pipeline(_pool("prefill", g0, g0s, _inst("p0")),
                        _pool("decode", _inst("d0", "decode")), _router(), retry_wait_s=0.0)
        for size, want in ((1, "p0"), (2, "g0-0")):
            for tokens in (SHORT, LONG):
                gen = Generation("r", tokens, "t", pb.Sampling(max_tokens=4),
                                 prefill_group_size=size)
                assert (await pipe._route(gen, None, 0, "")).prefill.instance_id == want
        gen = Generation("r", SHORT, "t", pb.Sampling(max_tokens=4), prefill_group_size=4)
        with pytest.raises(NoCapacity, match="no prefill target with 4 stage"):
            await pipe._route(gen, None, 0, "")

    asyncio.run(main())
