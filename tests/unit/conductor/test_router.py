"""The live router turns the instances' load reports into one decision and one plan.

Instances here are the Conductor's real `Instance` records with load reports as workers send
them (the router makes no call: their channels are never used). What is checked is what the
workers receive: the pair, and the `KVPlan` both of them get.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.sched.admission import SLO, AdmissionConfig, Overloaded
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.conductor.serving.router import (
    MooncakeRouter,
    Route,
    RouteRequest,
    namespace_of,
    with_pairing,
)

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
