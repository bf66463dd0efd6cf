"""A retry that finds no usable instance waits (bounded) for one to come back instead of
answering 503 at once: a failed call benches its instance until the next good poll, and when
the other instance of the role is partitioned, that bench is the whole pool."""

from __future__ import annotations

import asyncio

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.instances import Instance, InstancePool
from mooncake_k8s.conductor.serving.pipeline import Pipeline
from mooncake_k8s.conductor.serving.router import MooncakeRouter


def _pool(role: str, *insts: Instance) -> InstancePool:
    pool = InstancePool(role, "", "")
    for i in insts:
        pool.instances[i.address] = i
    return pool


def _inst(addr: str, role: str) -> Instance:
    return Instance(addr, role, None, pb.LoadReport(ready=True), healthy=True)  # type: ignore[arg-type]


def test_a_retry_waits_for_a_benched_instance_a_first_attempt_does_not() -> None:
    async def main() -> None:
        p, d = _inst("p:1", "prefill"), _inst("d:1", "decode")
        prefills, decodes = _pool("prefill", p), _pool("decode", d)
        router = MooncakeRouter(Scheduler(SchedulerConfig(), load(BUILTIN_CPU_PROFILE),
                                          KVIndex()))
        pipe = Pipeline(prefills, decodes, router, retry_wait_s=30.0)
        prefills.mark_failed(p, "UNAVAILABLE: KV handoff failed")
        assert await pipe._candidates(0) == ([], [d])  # a first attempt never waits

        async def next_good_poll() -> None:
            await asyncio.sleep(0.3)
            p.healthy = True

        back = asyncio.ensure_future(next_good_poll())
        assert await pipe._candidates(1) == ([p], [d])
        await back

        pipe.retry_wait_s = 0.2  # nothing comes back: the wait ends, the router says why
        prefills.mark_failed(p, "UNAVAILABLE")
        assert await pipe._candidates(1) == ([], [d])

    asyncio.run(main())
