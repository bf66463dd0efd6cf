"""A handed-over stream's bookkeeping on the Conductor when its continuation cannot go ahead.

The pipeline, pools, router and metrics are the real ones; the decode instances are addresses
where nothing listens (a dead instance: a real gRPC call fails UNAVAILABLE at once). The happy
path, a real continuation with the real model, is tests/e2e/test_drain.py. What is checked: a
continuation that fails before its first token takes the failover path (a plain DecodeLost,
`fallback` counted, the instance out of rotation); a handoff whose context is not the stream's
is never continued; with no other decode of the revision the stream ends, `failed` counted;
the draining instance is never chosen again for the stream, whatever a late poll said.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc
import pytest
from prometheus_client import generate_latest

from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.errors import DecodeFailed
from mooncake_k8s.conductor.serving.instances import Instance, InstancePool
from mooncake_k8s.conductor.serving.pipeline import Delta, Generation, Outcome, Pipeline
from mooncake_k8s.conductor.serving.resume import DecodeLost, HandedOff
from mooncake_k8s.conductor.serving.router import MooncakeRouter
from mooncake_k8s.store.testing import metric_value

BT = 16
PROMPT = list(range(1, 41))
STREAMED = [101, 102, 103]


def _inst(name: str, role: str) -> Instance:
    addr = f"127.0.0.1:{free_port()}"  # nothing listens: a call fails UNAVAILABLE
    rep = pb.LoadReport(instance_id=name, role=role, revision="v1", model="m",
                        model_fingerprint="ab" * 16, dtype="float32", block_tokens=BT,
                        max_context=4096, ready=True, kv_capacity_tokens=10_000,
                        kv_free_tokens=10_000)
    return Instance(addr, role, grpc.aio.insecure_channel(addr), rep, healthy=True)


def _pool(role: str, *insts: Instance) -> InstancePool:
    pool = InstancePool(role, "", "")
    for i in insts:
        pool.instances[i.address] = i
    return pool


def _pipeline(*decodes: Instance) -> tuple[Pipeline, ConductorMetrics]:
    metrics = ConductorMetrics()
    router = MooncakeRouter(Scheduler(SchedulerConfig(block_tokens=BT), load(BUILTIN_CPU_PROFILE),
                                      KVIndex()))
    return Pipeline(_pool("prefill", _inst("p0", "prefill")), _pool("decode", *decodes),
                    router, metrics=metrics, retry_wait_s=0.0), metrics


def _handed(inst: Instance, context: int) -> HandedOff:
    return HandedOff(inst, pb.DecodeHandoff(context_tokens=context, tail_key="tail-x",
                                            stored_blocks=context // BT, reason="drain"))


async def _drain(deltas: AsyncGenerator[Delta, None]) -> list[Delta]:
    return [d async for d in deltas]


async def _close(pipe: Pipeline) -> None:
    await pipe.prefills.close()
    await pipe.decodes.close()


def _outcomes(metrics: ConductorMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {o: metric_value(text, "mooncake_conductor_handoffs_total", f'outcome="{o}"')
            for o in ("ok", "fallback", "failed")}


GEN = Generation("req", PROMPT, "t", pb.Sampling(max_tokens=16))


def test_a_continuation_failing_before_a_token_falls_back_to_failover() -> None:
    async def main() -> None:
        draining, other = _inst("d0", "decode"), _inst("d1", "decode")
        pipe, metrics = _pipeline(draining, other)
        handed = _handed(draining, len(PROMPT) + len(STREAMED) - 1)
        with pytest.raises(DecodeLost) as info:
            await _drain(pipe._continue(GEN, STREAMED, handed, 1, Outcome(), 0.0))
        assert not isinstance(info.value, HandedOff)  # the caller re-prefills
        assert info.value.instance is other  # continued on the other one, not the draining
        assert not other.healthy and "UNAVAILABLE" in other.last_error
        assert _outcomes(metrics) == {"ok": 0, "fallback": 1, "failed": 0}
        await _close(pipe)

    asyncio.run(main())


def test_a_handoff_whose_context_is_not_the_streams_is_never_continued() -> None:
    async def main() -> None:
        draining, other = _inst("d0", "decode"), _inst("d1", "decode")
        pipe, metrics = _pipeline(draining, other)
        handed = _handed(draining, len(PROMPT) + len(STREAMED))  # one token too many
        with pytest.raises(DecodeLost, match="the stream has 42"):
            await _drain(pipe._continue(GEN, STREAMED, handed, 1, Outcome(), 0.0))
        assert other.healthy and other.inflight == 0  # no call was made
        assert _outcomes(metrics) == {"ok": 0, "fallback": 1, "failed": 0}
        await _close(pipe)

    asyncio.run(main())


def test_with_no_other_decode_the_stream_ends_and_failed_is_counted() -> None:
    async def main() -> None:
        draining = _inst("d0", "decode")  # still ready by its last poll
        pipe, metrics = _pipeline(draining)
        handed = _handed(draining, len(PROMPT) + len(STREAMED) - 1)
        with pytest.raises(DecodeFailed, match="no decode instance of revision 'v1' is left"):
            await _drain(pipe._continue(GEN, STREAMED, handed, 1, Outcome(), 0.0))
        assert _outcomes(metrics) == {"ok": 0, "fallback": 0, "failed": 1}
        await _close(pipe)

    asyncio.run(main())
