"""Conductor replicas: the same choices for the same state, and decode bookings between them
bounded by one poll of the other replicas' admissions (`serving.bookings`).

Each replica is a real `MooncakeRouter` with its own `Instance` records, as each Conductor
process has; a "poll" gives every replica's records a fresh report built from what the decode
instances really accepted (here: every stream routed, none finished).
"""

from __future__ import annotations

import asyncio

import grpc

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.bookings import DecodeBookings
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.conductor.serving.router import MooncakeRouter, RouteRequest


def _report(role: str, name: str, **fields: object) -> pb.LoadReport:
    base: dict[str, object] = {"kv_capacity_tokens": 100_000, "kv_free_tokens": 100_000}
    return pb.LoadReport(instance_id=name, role=role, revision="v1", model="m",
                         model_fingerprint="ab" * 16, dtype="bfloat16", block_tokens=8,
                         max_context=4096, ready=True,
                         **{**base, **fields})  # type: ignore[arg-type]


def _inst(role: str, name: str) -> Instance:
    return Instance(f"{name}:1", role, grpc.aio.insecure_channel("127.0.0.1:1"),
                    _report(role, name), True)


def _router(policy: str = "global_cache_aware") -> MooncakeRouter:
    return MooncakeRouter(Scheduler(SchedulerConfig(policy=policy),
                                    load(BUILTIN_CPU_PROFILE), KVIndex()))


def _req(i: int) -> RouteRequest:
    return RouteRequest(f"r{i}", list(range(1 + i, 41 + i)), "t", 16)


def test_replicas_choose_alike_whatever_order_they_list_instances_in() -> None:
    async def main() -> None:
        for policy in ("global_cache_aware", "load_balancing", "random"):
            a, b = _router(policy), _router(policy)
            pa = [_inst("prefill", n) for n in ("p0", "p1", "p2")]
            da = [_inst("decode", n) for n in ("d0", "d1", "d2")]
            pb_ = [_inst("prefill", n) for n in ("p2", "p0", "p1")]
            db = [_inst("decode", n) for n in ("d1", "d2", "d0")]
            for i in range(6):
                ra = await a.route(_req(i), pa, da)
                rb = await b.route(_req(i), pb_, db)
                assert (ra.prefill.address, ra.decode.address) == \
                    (rb.prefill.address, rb.decode.address), (policy, i)
                assert ra.plan == rb.plan

    asyncio.run(main())


def test_random_policy_draws_from_the_request() -> None:
    async def main() -> None:
        picks = set()
        for i in range(12):
            r = _router("random")  # a fresh replica each time: only the request decides
            ps = [_inst("prefill", f"p{j}") for j in range(4)]
            ds = [_inst("decode", f"d{j}") for j in range(4)]
            first = await r.route(_req(i), ps, ds)
            again = await _router("random").route(_req(i), ps, ds)
            assert first.prefill is again.prefill and first.decode is again.decode
            picks.add(first.prefill.address)
        assert len(picks) > 1, "the draw depends on the request"

    asyncio.run(main())


def test_decode_bookings_between_replicas_are_bounded_by_one_poll() -> None:
    """Two replicas alternate requests over two decode instances; polls come every
    `POLL` admissions. Each replica's view of an instance never undercounts it by more than
    the other replica's admissions since its latest poll, and the streams stay balanced."""
    POLL = 4
    names = ("d0", "d1")

    async def main() -> None:
        replicas = [_router("load_balancing") for _ in range(2)]
        prefills = [[_inst("prefill", "p0")] for _ in replicas]
        decodes = [[_inst("decode", n) for n in names] for _ in replicas]
        truth = dict.fromkeys(names, 0)
        others_since_poll = [0, 0]
        for i in range(40):
            x = i % 2
            r = replicas[x]
            for inst in decodes[x]:
                view = r._decode_view(inst)
                real = truth[inst.report.instance_id]  # type: ignore[union-attr]
                assert real - others_since_poll[x] <= view.running <= real, (i, view, real)
            route = await r.route(_req(i), prefills[x], decodes[x])
            truth[route.decode.report.instance_id] += 1  # type: ignore[union-attr]
            others_since_poll[1 - x] += 1
            if (i + 1) % POLL == 0:
                for ds in decodes:
                    for inst in ds:
                        n = truth[inst.report.instance_id]  # type: ignore[union-attr]
                        inst.report = _report(
                            "decode", inst.report.instance_id,  # type: ignore[union-attr]
                            running=n, accepted_streams=n, kv_free_tokens=100_000 - 56 * n)
                others_since_poll = [0, 0]
            assert abs(truth["d0"] - truth["d1"]) <= POLL // 2 + 1, (i, truth)
        assert sum(truth.values()) == 40

    asyncio.run(main())


def test_bookings_restart_and_age() -> None:
    b = DecodeBookings(max_age_s=10)
    r0 = _report("decode", "d", accepted_streams=5)
    b.book("d:1", 100, r0, now=0.0)
    b.book("d:1", 50, r0, now=1.0)
    assert b.pending("d:1", r0, now=2.0) == (2, 150)
    assert b.pending("d:1", _report("decode", "d", accepted_streams=6), now=2.0) == (1, 50)
    # The count went down: the decode restarted, the streams booked on its old process died.
    assert b.pending("d:1", _report("decode", "d", accepted_streams=0), now=2.0) == (0, 0)
    r1 = _report("decode", "d", accepted_streams=0)
    b.book("d:1", 70, r1, now=3.0)
    assert b.pending("d:1", r1, now=12.0) == (1, 70)
    assert b.pending("d:1", r1, now=13.5) == (0, 0)  # never reached the decode: aged out
    assert b.pending("other:1", None) == (0, 0)


def test_bookings_on_a_decode_that_reports_no_count_are_kept_a_few_polls() -> None:
    """A decode without `accepted_streams` (an older version mid-rollout) never moves the
    count: its `running` is what counts the bookings, after a poll or two."""
    b = DecodeBookings(max_age_s=120, uncounted_age_s=2)
    old = _report("decode", "d", running=3)
    b.book("d:1", 10, old, now=0.0)
    assert b.pending("d:1", old, now=1.5) == (1, 10)
    assert b.pending("d:1", _report("decode", "d", running=4), now=2.5) == (0, 0)
