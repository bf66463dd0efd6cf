"""The embedded kind opened the way a worker opens it (the registry, an EngineContext, the
worker's store client): prefill hands the KV to decode through a real store on loopback, and
the tokens are the ones the engine generates alone."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import pytest

from mooncake_k8s.common.blocks import HEADER_SIZE
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
from mooncake_k8s.engine.embedded.adapter import EmbeddedDecode
from mooncake_k8s.engine.embedded.testing import all_blocks, generate, prompt_tokens
from mooncake_k8s.engine.registry import engine_kind
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import store_cluster


@pytest.fixture(scope="module")
def bed() -> Iterator[tuple[PrefillEngine, DecodeEngine, StoreClient]]:
    kind = engine_kind("embedded")
    with store_cluster(nodes=1) as cluster, cluster.client() as store:

        def context(role: Role) -> EngineContext:
            return EngineContext(role, EngineConfig(threads=1), kind.settings({}), store,
                                 cluster.master_address, cluster.token)

        prefill = kind.open_prefill(context("prefill"))
        decode = kind.open_decode(context("decode"))
        try:
            yield prefill, decode, store
        finally:
            prefill.close()
            decode.close()


@pytest.fixture
def engines(bed: tuple[PrefillEngine, DecodeEngine, StoreClient]
            ) -> tuple[PrefillEngine, DecodeEngine]:
    return bed[0], bed[1]


@pytest.fixture
def store(bed: tuple[PrefillEngine, DecodeEngine, StoreClient]) -> StoreClient:
    return bed[2]


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


def test_kv_loaded_from_the_segment_decodes_as_a_cold_run(
        engines: tuple[PrefillEngine, DecodeEngine], engine: Engine) -> None:
    """Prompts of other lengths in turn through one decode (its staging buffer and KV memory
    reused from the one before): each continuation is the cold run's, and each admission
    reports the KV bytes it loaded."""
    prefill, decode = engines
    bt = prefill.info.block_tokens
    assert isinstance(decode, EmbeddedDecode)
    decode.load_seconds()
    for i, n in enumerate((2 * bt + 5, bt + 40, 2 * bt)):
        tokens = prompt_tokens(engine, n, variant=20 + i)
        sampling = pb.Sampling(temperature=0, max_tokens=6)
        keys = tuple(prefill.info.block_keys(tokens))
        done = prefill.prefill(PrefillWork(f"seg-{i}", tokens, "", sampling, KVPlan(keys)))
        work = DecodeWork(f"seg-{i}", tokens, "", done.first_token, sampling, list(keys),
                          done.tail_key)
        out = list(decode.decode(work, threading.Event()))
        alone, _, _ = generate(engine, tokens, SamplingParams(temperature=0, max_tokens=6))
        assert [done.first_token, *(t.token_id for t in out)] == alone, n
        ((seconds, nbytes),) = decode.load_seconds()
        assert seconds > 0 and nbytes == engine.layout.block_bytes(bt) * (n // bt) + (
            engine.layout.block_bytes(n % bt) if n % bt else 0)


def _flip_in_segment(store: StoreClient, key: str, at: int) -> None:
    """Flip one byte of `key`'s only replica where it lies, in the node's shared memory (as
    a memory fault or a stray write would): the store's checksum no longer matches."""
    info = store._lookup([key])[0]
    assert info is not None and len(info.replicas) == 1
    loc = info.replicas[0]
    with open(loc.segment.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[loc.offset + at] ^= 0x20


def test_a_block_corrupted_in_the_segment_is_never_used(
        engines: tuple[PrefillEngine, DecodeEngine], store: StoreClient,
        engine: Engine) -> None:
    """The store's checksum, verified as the block is read, is the one check of its payload
    on this path: decode fails the request (the Conductor retries it from prefill), and a
    prefill of the prompt recomputes from the bad block with the cold run's first token."""
    prefill, decode = engines
    bt = prefill.info.block_tokens
    tokens = [1234, *prompt_tokens(engine, 3 * bt - 1, variant=30)]  # its own first block
    sampling = pb.Sampling(temperature=0, max_tokens=4)
    keys = tuple(prefill.info.block_keys(tokens))
    done = prefill.prefill(PrefillWork("bad-0", tokens, "", sampling, KVPlan(keys)))
    assert done.stored_blocks == 3
    _flip_in_segment(store, keys[1], HEADER_SIZE + 1000)
    work = DecodeWork("bad-1", tokens, "", done.first_token, sampling, list(keys))
    with pytest.raises(KVMissing, match="1 of 3 KV blocks missing"):
        list(decode.decode(work, threading.Event()))
    again = prefill.prefill(PrefillWork("bad-2", tokens, "", sampling,
                                        KVPlan(keys, fetch_blocks=3)))
    assert again.cached_tokens == bt and again.imported_blocks == 1
    assert again.first_token == done.first_token
    assert decode.load().running == 0


def test_decode_asks_the_store_to_keep_what_it_read_from_another_host(engine: Engine) -> None:
    """A decode whose store client is on another host than the prompt's blocks (a client
    with its own host id) reads them over TCP and hands the plan's `keep_on` segment to the
    store with the read, and decodes as a cold run. On one machine every node shares one
    host, which holds a copy already, so the store keeps none (it keeps one copy per host)
    and counts each as skipped: that count is what shows decode asked. Keeping across real
    hosts is the store's to test (and the test bed's)."""
    kind = engine_kind("embedded")
    bt = engine.block_tokens
    params = SamplingParams(temperature=0, max_tokens=4)
    tokens = [4321, *prompt_tokens(engine, 2 * bt + 6, variant=40)]
    res = engine.prefill(tokens, [], params)
    keys = engine.block_keys(tokens)
    with store_cluster(nodes=2) as cluster, cluster.client() as writer, \
            cluster.client(host_id="decode-host") as remote:
        assert writer.batch_put([*keys, "tail/keep-1"], all_blocks(res), placement="preferred",
                                preferred_segment="n0-dram-0") == [None] * 3
        ctx = EngineContext("decode", EngineConfig(threads=1), kind.settings({}), remote,
                            cluster.master_address, cluster.token)
        decode = kind.open_decode(ctx)
        try:
            work = DecodeWork("keep-1", tokens, "", res.first_token,
                              pb.Sampling(temperature=0, max_tokens=4), keys, "tail/keep-1",
                              keep_on="n1-dram-0")
            out = list(decode.decode(work, threading.Event()))
        finally:
            decode.close()
        alone, _, _ = generate(engine, tokens, params)
        assert [res.first_token, *(t.token_id for t in out)] == alone
        assert (remote.keep_skipped, remote.kept_blocks, remote.keep_failures) == (3, 0, 0)
