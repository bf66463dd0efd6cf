"""A plan that contradicts itself is refused by `resolve_plan`, the one place prefill and decode
judge a plan (each service answers the InvalidArgument with INVALID_ARGUMENT; the e2e test
`test_serving.test_a_malformed_plan_is_refused_by_both_workers` sees the status)."""

from __future__ import annotations

import re

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import EngineInfo, plan_error, resolve_plan

INFO = EngineInfo("embedded", "m", "ab" * 16, "bfloat16", 4, 128)
TOKENS = list(range(10))  # two full blocks of 4


def _plan(**kw: object) -> pb.KVPlan:
    return pb.KVPlan(block_keys=INFO.block_keys(TOKENS),
                     namespace=INFO.namespace().digest().hex(), planned=True,
                     **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("plan", "why"), [
    (_plan(local_blocks=2, fetch_blocks=1), "local_blocks + fetch_blocks = 3 but only 2"),
    (_plan(bootstrap_addr="127.0.0.1:9"), "needs both bootstrap_addr and bootstrap_room"),
    (pb.KVPlan(bootstrap_room=7), "needs both bootstrap_addr and bootstrap_room"),
    (pb.KVPlan(planned=True), "planned is set but namespace is empty"),
])
def test_a_self_contradicting_plan_is_refused(plan: pb.KVPlan, why: str) -> None:
    assert why in (plan_error(plan) or "")
    for use_cache in (True, False):
        with pytest.raises(InvalidArgument, match=f"malformed KV plan: .*{re.escape(why)}"):
            resolve_plan(plan, INFO, TOKENS, "", use_cache)


@pytest.mark.parametrize("plan", [
    pb.KVPlan(),  # no decision: the worker looks up itself
    _plan(local_blocks=1, fetch_blocks=1, write_segment="seg"),
    _plan(bootstrap_addr="127.0.0.1:9", bootstrap_room=3),
    # Another namespace but well formed: not trusted (recomputed), not refused.
    pb.KVPlan(block_keys=["0" * 32] * 2, namespace="cd" * 16, fetch_blocks=2, planned=True),
])
def test_well_formed_plans_pass(plan: pb.KVPlan) -> None:
    assert plan_error(plan) is None
    resolved, _ = resolve_plan(plan, INFO, TOKENS, "", True)
    assert resolved.bootstrap_room == plan.bootstrap_room
