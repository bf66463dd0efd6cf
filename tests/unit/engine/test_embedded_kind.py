"""The embedded kind opened the way a worker opens it (the registry, an EngineContext, the
worker's store client): prefill hands the KV to decode through a real store on loopback, and
the tokens are the ones the engine generates alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import (
    DecodeEngine,
    DecodeWork,
    EngineContext,
    KVMissing,
    KVPlan,
    PrefillEngine,
    PrefillWork,
    Role,
)
from mooncake_k8s.engine.embedded import Engine, EngineConfig, SamplingParams
from mooncake_k8s.engine.embedded.testing import generate, prompt_tokens
from mooncake_k8s.engine.registry import engine_kind
from mooncake_k8s.store.testing import store_cluster


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    kind = engine_kind("embedded")
    with store_cluster(nodes=1) as cluster, cluster.client() as store:

        def context(role: Role) -> EngineContext:
            return EngineContext(role, EngineConfig(threads=1), kind.settings({}), store,
                                 cluster.master_address, cluster.token)

        prefill = kind.open_prefill(context("prefill"))
        decode = kind.open_decode(context("decode"))
        try:
            yield prefill, decode
        finally:
            prefill.close()
            decode.close()


def test_prefill_hands_the_kv_to_decode_through_the_store(
        engines: tuple[PrefillEngine, DecodeEngine], engine: Engine) -> None:
    prefill, decode = engines
    info = prefill.info
    assert info.kind == "embedded" and decode.info == info
    tokens = prompt_tokens(engine, 2 * info.block_tokens + 10)
    sampling = pb.Sampling(temperature=0, max_tokens=8)
    plan = KVPlan(tuple(info.block_keys(tokens)))
    done = prefill.prefill(PrefillWork("kind-1", tokens, "", sampling, plan))
    assert (done.cached_tokens, done.stored_blocks) == (0, 2) and done.tail_key

    work = DecodeWork("kind-1", tokens, "", done.first_token, sampling, list(plan.keys),
                      done.tail_key)
    out = list(decode.decode(work, threading.Event()))
    alone, _, reason = generate(engine, tokens, SamplingParams(temperature=0, max_tokens=8))
    assert [done.first_token, *(t.token_id for t in out)] == alone
    assert out[-1].finished and out[-1].finish_reason == reason
    steps = decode.step_seconds()
    assert len(steps) >= len(out) - 1 and all(s > 0 for s in steps)
    assert decode.step_seconds() == [], "each step is reported once"
    assert decode.load().running == 0

    again = prefill.prefill(PrefillWork("kind-2", tokens, "", sampling,
                                        KVPlan(plan.keys, fetch_blocks=2)))
    assert again.cached_tokens == 2 * info.block_tokens and again.stored_blocks == 0
    assert again.first_token == done.first_token


def test_decode_without_the_kv_in_the_store_fails_the_request_alone(
        engines: tuple[PrefillEngine, DecodeEngine]) -> None:
    _, decode = engines
    tokens = list(range(100, 100 + decode.info.block_tokens))
    work = DecodeWork("kind-missing", tokens, "", 5, pb.Sampling(temperature=0, max_tokens=4),
                      decode.info.block_keys(tokens))
    with pytest.raises(KVMissing, match="1 of 1 KV blocks missing"):
        list(decode.decode(work, threading.Event()))
    assert decode.failure() is None and decode.load().running == 0
