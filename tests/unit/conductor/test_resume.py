"""Decode failover, the pure part: what a resumed stream asks for (`conductor.resume`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.conductor.serving.resume import (
    DecodeLost,
    HandedOff,
    continued_prompt,
    continued_sampling,
    handoff_mismatch,
    resume_candidates,
    resume_request_id,
    resumed_prompt,
    resumed_sampling,
    with_seed,
)


def _inst(name: str, revision: str, channel: grpc.aio.Channel) -> Instance:
    return Instance(name, "decode", channel,
                    pb.LoadReport(instance_id=name, role="decode", revision=revision))


def test_a_continuation_loads_all_but_the_last_streamed_token_and_goes_on_from_it() -> None:
    # The last streamed token's KV is not computed yet: it is the new call's first token.
    assert continued_prompt([1, 2, 3], [7, 8, 9]) == ([1, 2, 3, 7, 8], 9)
    assert continued_prompt([1, 2, 3], [7]) == ([1, 2, 3], 7)
    with pytest.raises(ValueError, match="nothing was streamed"):
        continued_prompt([1, 2, 3], [])


def test_a_continuation_counts_its_first_token_toward_max_tokens() -> None:
    # 10 streamed of 64: the new first token is the 10th, so 55 more make the undisturbed 64.
    s = pb.Sampling(temperature=0.7, max_tokens=64, has_seed=True, seed=3)
    r = continued_sampling(s, 10)
    assert r.max_tokens == 55
    assert (r.seed, r.has_seed, r.temperature) == (3, True, s.temperature)
    assert continued_sampling(s, 64).max_tokens == 1  # only the already-streamed one


def test_a_handoff_whose_context_is_not_the_streams_is_refused() -> None:
    ok = pb.DecodeHandoff(context_tokens=12, tail_key="t", stored_blocks=0, reason="drain")
    assert handoff_mismatch(ok, prompt=10, streamed=3) == ""
    assert "the stream has 13" in handoff_mismatch(ok, prompt=10, streamed=4)
    assert "before any token" in handoff_mismatch(ok, prompt=12, streamed=0)


def test_a_handoff_is_a_lost_decode_of_its_revision() -> None:
    async def main() -> None:
        ch = grpc.aio.insecure_channel("127.0.0.1:1")
        e = HandedOff(_inst("d0", "v2", ch), pb.DecodeHandoff(context_tokens=5, reason="drain"))
        assert isinstance(e, DecodeLost)
        assert e.revision == "v2" and e.handoff.context_tokens == 5
        assert "d0 handed the stream over (drain)" in str(e)
        await ch.close(None)

    asyncio.run(main())


def test_the_prompt_is_the_original_then_what_the_client_has() -> None:
    assert resumed_prompt([1, 2, 3], [7, 8]) == [1, 2, 3, 7, 8]
    assert resumed_prompt([1], []) == [1]


def test_sampling_keeps_everything_but_the_tokens_left() -> None:
    s = pb.Sampling(temperature=0.7, top_p=0.9, max_tokens=64, stop=["\n\n"], has_seed=True,
                    seed=-5, ignore_eos=True)
    r = resumed_sampling(s, 10)
    assert r.max_tokens == 54
    r.max_tokens = 64
    assert r == s
    assert s.max_tokens == 64  # the original is not changed


@pytest.mark.parametrize("produced", [64, 65])
def test_nothing_left_to_produce_is_refused(produced: int) -> None:
    with pytest.raises(ValueError, match="nothing left to resume"):
        resumed_sampling(pb.Sampling(max_tokens=64), produced)


def test_a_sampled_request_gets_one_seed_for_its_life() -> None:
    s = pb.Sampling(temperature=0.8, max_tokens=5)
    seeded = with_seed(s)
    assert seeded.has_seed and 0 <= seeded.seed < 1 << 63
    assert not s.has_seed
    assert with_seed(seeded) == seeded  # kept, never redrawn
    given = pb.Sampling(temperature=0.8, has_seed=True, seed=0)
    assert with_seed(given) == given  # seed 0 is a seed
    greedy = pb.Sampling(temperature=0.0)
    assert not with_seed(greedy).has_seed


def test_resume_ids_are_fresh() -> None:
    assert resume_request_id("abc", 1) != resume_request_id("abc", 2) != "abc"


def test_candidates_are_of_the_lost_revision() -> None:
    asyncio.run(_candidates())


async def _candidates() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never connected
    try:
        lost_on = _inst("d0", "v1", channel)
        same, other = _inst("d1", "v1", channel), _inst("d2", "v2", channel)
        lost = DecodeLost(lost_on, "decode instance d0 failed mid-stream")
        assert lost.revision == "v1" and str(lost).startswith("decode instance d0")
        assert resume_candidates([same, other], lost.revision) == [same]
        assert resume_candidates([other], lost.revision) == []
    finally:
        await channel.close(None)
