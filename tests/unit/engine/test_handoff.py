"""Handoff of a live decode sequence (drain): the engine exports its context KV as blocks and
drops it, and a sequence admitted from those blocks continues exactly as the undisturbed one
would have (real model; greedy and seeded sampling)."""

from __future__ import annotations

import pytest

from mooncake_k8s.engine.embedded import Engine, SamplingParams
from mooncake_k8s.engine.embedded.testing import all_blocks, decode_alone
from mooncake_k8s.engine.embedded.testing import prompt_tokens as prompt

MAX = 10
SAMPLINGS = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
             SamplingParams(temperature=0.9, max_tokens=MAX, seed=11, ignore_eos=True)]


def _run_until(engine: Engine, seq_id: str, steps: int, tokens: list[int]) -> None:
    for _ in range(steps):
        for out in engine.step():
            assert out.seq_id == seq_id and not out.finished
            tokens.append(out.token_id)


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded"])
def test_a_handed_over_sequence_continues_as_if_undisturbed(
        fresh: Engine, params: SamplingParams) -> None:
    engine = fresh
    ids = prompt(engine, 60, variant=21)
    res = engine.prefill(ids, [], params, seq_id="p")
    want, _, _ = decode_alone(engine, "undisturbed", ids, all_blocks(res), res.first_token,
                              params)
    assert len(want) == MAX
    bt = engine.block_tokens
    for steps in (3, 4):  # a context of 63 tokens (a tail), then of 64 (whole blocks)
        engine.add_sequence("a", ids, all_blocks(res), res.first_token, params)
        got = [res.first_token]
        _run_until(engine, "a", steps, got)
        exp = engine.export("a")
        assert exp is not None and not engine.has_sequence("a")
        assert engine.load().kv_used_tokens == 0
        # The context is the prompt and every token but the last (its KV is not computed).
        context = ids + got[:-1]
        assert (exp.length, exp.next_token) == (len(context), got[-1])
        assert [i for i, _ in exp.blocks] == list(range(len(context) // bt))
        assert (exp.tail is None) == (len(context) % bt == 0)

        blocks = [b for _, b in exp.blocks] + ([exp.tail] if exp.tail is not None else [])
        left = SamplingParams(temperature=params.temperature,
                              max_tokens=MAX - (len(got) - 1), seed=params.seed,
                              ignore_eos=True)
        rest, _, reason = decode_alone(engine, "b", context, blocks, exp.next_token, left)
        assert reason == "length"
        assert got[:-1] + rest == want  # no token twice, none missing, the same ones


def test_export_from_a_block_skips_the_leading_ones_and_keeps_the_bits(fresh: Engine) -> None:
    """The prompt's blocks come out byte for byte as they went in (the resuming instance
    reads the same KV bits), and `first_block` leaves out those present elsewhere."""
    engine = fresh
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = prompt(engine, 150, variant=22)  # two full blocks and a tail
    res = engine.prefill(ids, [], params, seq_id="c")
    prompt_blocks = all_blocks(res)
    engine.add_sequence("c", ids, prompt_blocks, res.first_token, params)
    got = [res.first_token]
    _run_until(engine, "c", 3, got)
    exp = engine.export("c", first_block=1)
    assert exp is not None
    assert [i for i, _ in exp.blocks] == [1]
    assert bytes(exp.blocks[0][1]) == bytes(prompt_blocks[1])
    assert exp.tail is not None and exp.length == 150 + 3
    assert engine.export("c") is None  # dropped: nothing left to export


def test_remaining_counts_what_each_sequence_may_still_produce(fresh: Engine) -> None:
    engine = fresh
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = prompt(engine, 40, variant=23)
    res = engine.prefill(ids, [], params, seq_id="d")
    engine.add_sequence("d", ids, all_blocks(res), res.first_token, params)
    assert engine.remaining() == {"d": 11}
    _run_until(engine, "d", 4, [res.first_token])
    assert engine.remaining() == {"d": 7}
    engine.abort("d")
    assert engine.remaining() == {}
