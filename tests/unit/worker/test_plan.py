"""How a worker decides whether to follow the Conductor's KV plan."""

from __future__ import annotations

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import EngineInfo, resolve_plan

INFO = EngineInfo("vllm", "m", "ab" * 16, "bfloat16", 4, 128, "vllm-cpu")
TOKENS = list(range(10))  # two full blocks of 4


def _plan(info: EngineInfo = INFO, tenant: str = "", **kw: object) -> pb.KVPlan:
    keys = info.block_keys(TOKENS, tenant)
    return pb.KVPlan(block_keys=keys, namespace=info.namespace(tenant).digest().hex(),
                     planned=True, **kw)  # type: ignore[arg-type]


def test_a_plan_in_our_namespace_is_followed_as_given() -> None:
    msg = _plan(local_blocks=1, fetch_blocks=1, write_segment="seg-a")
    plan, trusted = resolve_plan(msg, INFO, TOKENS, "", True)
    assert trusted and plan.planned
    assert plan.keys == tuple(msg.block_keys) and plan.reuse_blocks == 2
    assert plan.write_segment == "seg-a"


def test_a_plan_from_another_namespace_is_recomputed_not_trusted() -> None:
    for other in (EngineInfo("embedded", "m", "ab" * 16, "bfloat16", 4, 128),  # other producer
                  EngineInfo("vllm", "m", "cd" * 16, "bfloat16", 4, 128, "vllm-cpu")):
        msg = _plan(other, fetch_blocks=2)
        plan, trusted = resolve_plan(msg, INFO, TOKENS, "", True)
        assert not trusted and not plan.planned
        assert plan.keys == tuple(INFO.block_keys(TOKENS))


def test_another_tenants_plan_is_not_trusted() -> None:
    plan, trusted = resolve_plan(_plan(tenant="a", fetch_blocks=2), INFO, TOKENS, "b", True)
    assert not trusted and plan.keys == tuple(INFO.block_keys(TOKENS, "b"))


def test_no_plan_means_look_up_and_no_cache_means_reuse_nothing() -> None:
    plan, trusted = resolve_plan(pb.KVPlan(), INFO, TOKENS, "", True)
    assert not trusted and not plan.planned
    plan, _ = resolve_plan(_plan(fetch_blocks=2), INFO, TOKENS, "", False)
    assert plan.planned and plan.reuse_blocks == 0


def test_producers_never_share_keys() -> None:
    embedded = EngineInfo("embedded", "m", "ab" * 16, "bfloat16", 4, 128)
    assert not set(embedded.block_keys(TOKENS)) & set(INFO.block_keys(TOKENS))
