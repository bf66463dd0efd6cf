"""The KV connector's scheduler side: what it promises vLLM and plans for the workers.

vLLM's request and scheduler-output objects are stood in for by plain namespaces carrying the
fields the connector reads (vLLM itself runs in tests/e2e/test_vllm.py); the connector is ours
and real. No store is contacted: every request here carries a plan.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():  # vLLM's imports warn about torch deprecations
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_k8s.engine.vllm.connector import PARAMS_KEY, MooncakeK8sConnector

BS = 4
K = [f"{i:032x}" for i in range(4)]  # plan keys as the Conductor sends them (128-bit hex)


def _connector() -> MooncakeK8sConnector:
    ktc = NS(kv_connector_extra_config={"master": "127.0.0.1:1", "fingerprint": "ab" * 16},
             is_kv_producer=True)
    cfg = NS(kv_transfer_config=ktc, cache_config=NS(block_size=BS, cache_dtype="auto"),
             model_config=NS(dtype=torch.bfloat16))
    return MooncakeK8sConnector(cfg, KVConnectorRole.SCHEDULER, None)


def _request(rid: str, n: int, **params: Any) -> NS:
    return NS(request_id=rid, prompt_token_ids=list(range(100, 100 + n)),
              kv_transfer_params={PARAMS_KEY: params})


def _step(new: Sequence[NS] = (), cached: Sequence[NS] = (),
          resumed: frozenset[str] = frozenset(), scheduled: dict[str, int] | None = None) -> NS:
    return NS(scheduled_new_reqs=list(new), num_scheduled_tokens=scheduled or {},
              scheduled_cached_reqs=NS(req_ids=[c.req_id for c in cached],
                                       new_block_ids=[c.new_block_ids for c in cached],
                                       num_computed_tokens=[c.num_computed for c in cached],
                                       resumed_req_ids=set(resumed)))


def test_plan_reuse_is_promised_less_one_token_and_loaded_into_the_right_blocks() -> None:
    c = _connector()
    req = _request("r", 12, keys=[K[0], K[1], K[2]], reuse=3)  # 3 full blocks, all pooled
    # At least one prompt token is computed: only 2 of the 3 blocks can be loaded.
    assert c.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    c.update_state_after_alloc(req, None, 2 * BS)
    meta = c.build_connector_meta(_step(
        new=[NS(req_id="r", block_ids=([7, 8, 9],), num_computed_tokens=2 * BS)],
        scheduled={"r": 4}))
    assert [(ld.keys, ld.block_ids) for ld in meta.loads] == [([K[0], K[1]], [7, 8])]
    assert meta.saves == []  # the pool has every block already
    assert c._stats == {"lookups": 0, "planned": 1}


@pytest.mark.parametrize("keys", [["not-hex"], "k0k1", [1, 2], [K[0]] * 9])
def test_malformed_plan_keys_are_ignored_not_fatal(keys: Any) -> None:
    c = _connector()
    req = _request("r", 12, keys=keys, reuse=3)
    assert c.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    st = c._reqs["r"]
    assert len(st.keys) == 3 and all(len(k) == 32 for k in st.keys) and st.keys != keys


def test_local_hits_are_not_loaded_and_new_blocks_saved_as_chunks_complete() -> None:
    c = _connector()
    req = _request("r", 17, keys=[K[0], K[1], K[2], K[3]], reuse=2, write_segment="seg-d")
    # vLLM's own prefix cache holds block 0: only block 1 comes from the pool.
    assert c.get_num_new_matched_tokens(req, BS) == (BS, False)
    c.update_state_after_alloc(req, None, BS)
    m1 = c.build_connector_meta(_step(
        new=[NS(req_id="r", block_ids=([3, 4, 5],), num_computed_tokens=2 * BS)],
        scheduled={"r": 4}))  # chunked prefill: tokens 8..11 this step
    assert [(ld.keys, ld.block_ids) for ld in m1.loads] == [([K[1]], [4])]
    assert [(s.keys, s.block_ids, s.segments) for s in m1.saves] == [([K[2]], [5], ("seg-d",))]
    m2 = c.build_connector_meta(_step(
        cached=[NS(req_id="r", new_block_ids=([6, 11],), num_computed=3 * BS)],
        scheduled={"r": 5}))  # the rest of the prompt
    assert [(s.keys, s.block_ids) for s in m2.saves] == [([K[3]], [6])]
    assert m2.loads == []


@pytest.mark.parametrize(("home", "write", "want"), [
    ("seg-p", "seg-d", ("seg-p", "seg-d")),  # a copy on the prefill's host and one by decode
    ("seg-d", "seg-d", ("seg-d",)),  # the same segment: one copy
    ("", "seg-d", ("seg-d",)),
    ("seg-p", "", ("seg-p",)),
    (7, None, ()),  # malformed: the store places one copy
])
def test_new_blocks_get_a_replica_on_each_planned_segment(home: Any, write: Any,
                                                          want: tuple[str, ...]) -> None:
    c = _connector()
    req = _request("r", 9, keys=[K[0], K[1]], reuse=1, home_segment=home, write_segment=write,
                   keep_on="seg-p")
    assert c.get_num_new_matched_tokens(req, 0) == (BS, False)
    c.update_state_after_alloc(req, None, BS)
    meta = c.build_connector_meta(_step(
        new=[NS(req_id="r", block_ids=([1, 2, 3],), num_computed_tokens=BS)],
        scheduled={"r": 5}))
    assert [(s.keys, s.segments) for s in meta.saves] == [([K[1]], want)]
    # What it reads from another host is kept on the segment the plan names.
    assert [(ld.keys, ld.keep_on) for ld in meta.loads] == [([K[0]], "seg-p")]


def test_preempted_request_loads_again_into_its_new_blocks() -> None:
    c = _connector()
    req = _request("r", 9, keys=[K[0], K[1]], reuse=2)
    assert c.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    c.update_state_after_alloc(req, None, 2 * BS)
    c.build_connector_meta(_step(
        new=[NS(req_id="r", block_ids=([1, 2, 3],), num_computed_tokens=2 * BS)],
        scheduled={"r": 1}))
    # Preempted and rescheduled: vLLM asks again and hands over fresh blocks.
    assert c.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    c.update_state_after_alloc(req, None, 2 * BS)
    meta = c.build_connector_meta(_step(
        cached=[NS(req_id="r", new_block_ids=([9, 10, 12],), num_computed=2 * BS)],
        resumed=frozenset({"r"}), scheduled={"r": 1}))
    assert [(ld.keys, ld.block_ids) for ld in meta.loads] == [([K[0], K[1]], [9, 10])]


def test_decode_extends_the_plan_keys_by_its_chain_and_never_saves() -> None:
    c = _connector()
    prefill = _request("p", 7, reuse=0)  # computes its own keys (no "keys"): one full block
    c.get_num_new_matched_tokens(prefill, 0)
    given = c._reqs["p"].keys
    assert len(given) == 1
    # Decode's prompt is prompt + first token: 8 tokens, 2 full blocks, plan keys for 1.
    dec = NS(request_id="d", prompt_token_ids=[*range(100, 107), 5],
             kv_transfer_params={PARAMS_KEY: {"keys": given, "reuse": 1, "save": False}})
    assert c.get_num_new_matched_tokens(dec, 0) == (BS, False)
    st = c._reqs["d"]
    assert st.keys[0] == given[0] and len(st.keys) == 2 and not st.save
    c.update_state_after_alloc(dec, None, BS)
    meta = c.build_connector_meta(_step(
        new=[NS(req_id="d", block_ids=([4, 5],), num_computed_tokens=BS)],
        scheduled={"d": 4}))
    assert meta.saves == [] and len(meta.loads) == 1
    c.request_finished(dec, [4, 5])
    assert "d" not in c._reqs
