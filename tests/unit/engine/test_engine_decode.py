"""Decode: continuous batching, stop strings, max_tokens, seeds, admission limits (real model)."""

from __future__ import annotations

import pytest

from mooncake_k8s.common.blocks import HEADER_SIZE
from mooncake_k8s.common.errors import IntegrityError, InvalidArgument
from mooncake_k8s.engine.embedded import Engine, EngineFull, SamplingParams
from mooncake_k8s.engine.embedded.testing import GREEDY, all_blocks, decode_alone, generate
from mooncake_k8s.engine.embedded.testing import prompt_tokens as prompt

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_sequences_joining_midway_get_the_same_greedy_tokens(fresh: Engine) -> None:
    engine = fresh
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (14, 10, 12)]
    prompts = [prompt(engine, n, variant=v) for n, v in ((50, 3), (130, 4), (200, 5))]
    alone = [generate(engine, p, sp, seq_id=f"alone{i}")[0]
             for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]

    got: dict[str, list[int]] = {}

    def admit(i: int) -> None:
        res = engine.prefill(prompts[i], [], params[i])
        got[f"s{i}"] = [res.first_token]
        engine.add_sequence(f"s{i}", prompts[i], all_blocks(res), res.first_token, params[i])

    batch_sizes = []
    admit(0)
    for step in range(40):
        if step == 3:
            admit(1)
        if step == 5:
            admit(2)
        outs = engine.step()
        if not outs and step > 5:
            break
        batch_sizes.append(len(outs))
        for o in outs:
            got[o.seq_id].append(o.token_id)
    assert max(batch_sizes) == 3, "all three must have run in one step together"
    assert [got[f"s{i}"] for i in range(3)] == alone
    assert engine.load().running == 0 and engine.load().kv_used_tokens == 0


def test_stop_string_truncates_and_ends(fresh: Engine) -> None:
    engine = fresh
    ids = engine.chat_tokens(FRANCE)
    _, full_text, _ = generate(engine, ids, GREEDY)
    assert "France is Paris" in full_text
    for stop, expect in ((("France",), full_text[: full_text.index("France")]),
                         ((" is P", "zzz"), full_text[: full_text.index(" is P")])):
        params = SamplingParams(temperature=0, max_tokens=20, stop=stop)
        tokens, text, reason = generate(engine, ids, params)
        assert (text, reason) == (expect, "stop")
        assert len(tokens) < 20


def test_partial_stop_match_is_withheld_then_released(fresh: Engine) -> None:
    engine = fresh
    ids = engine.chat_tokens(FRANCE)
    _, full_text, _ = generate(engine, ids, GREEDY)
    stop = "Paris!!"  # "Paris" is a prefix of it, but the model writes "Paris."
    params = SamplingParams(temperature=0, max_tokens=20, stop=(stop,))
    res = engine.prefill(ids, [], params)
    emitted = res.text
    engine.add_sequence("w", ids, all_blocks(res), res.first_token, params)
    while engine.has_sequence("w"):
        for o in engine.step():
            emitted += o.text
            if not o.finished:
                assert not any(emitted.endswith(stop[:k]) for k in range(1, len(stop))), emitted
    assert emitted == full_text


def test_max_tokens_counts_the_first_token(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 70)
    params = SamplingParams(temperature=0, max_tokens=5)
    tokens, _, reason = generate(engine, ids, params)
    assert (len(tokens), reason) == (5, "length")
    res = engine.prefill(ids, [], SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(InvalidArgument, match="already finished at its first token"):
        engine.add_sequence("done", ids, all_blocks(res), res.first_token,
                            SamplingParams(temperature=0, max_tokens=1))


def test_seeded_sampling_is_reproducible(fresh: Engine) -> None:
    engine = fresh
    ids = engine.chat_tokens([{"role": "user", "content": "Write a short poem about the sea."}])
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234)
    a = generate(engine, ids, params, seq_id="a")
    b = generate(engine, ids, params, seq_id="b")
    assert a == b
    others = {tuple(generate(engine, ids, SamplingParams(temperature=1.0, top_p=0.95,
                                                         max_tokens=12, seed=s))[0])
              for s in (1, 2)}
    assert len(others | {tuple(a[0])}) > 1, "different seeds should give different samples"
    greedy = generate(engine, ids, SamplingParams(temperature=0, max_tokens=12))
    tiny_p = generate(engine, ids, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12,
                                                  seed=9))
    assert tiny_p[0] == greedy[0], "top_p near 0 keeps only the most likely token"


def test_admission_limits_raise_engine_full(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 10)
    params = SamplingParams(temperature=0, max_tokens=8)
    res = engine.prefill(ids, [], params)
    blocks = all_blocks(res)
    for i in range(engine.config.max_batch):
        engine.add_sequence(f"b{i}", ids, blocks, res.first_token, params)
    with pytest.raises(EngineFull, match="max_batch"):
        engine.add_sequence("one-too-many", ids, blocks, res.first_token, params)
    assert engine.load().running == engine.config.max_batch
    for i in range(engine.config.max_batch):
        engine.abort(f"b{i}")
    engine.abort("b0")  # idempotent

    long = prompt(engine, 100)
    res = engine.prefill(long, [], params)
    big = SamplingParams(temperature=0, max_tokens=8000)
    per_seq = 100 + 8000 - 1
    fits = engine.kv_capacity_tokens // per_seq
    for i in range(fits):
        engine.add_sequence(f"k{i}", long, all_blocks(res), res.first_token, big)
    load = engine.load()
    assert load.kv_used_tokens == fits * per_seq
    assert load.kv_free_tokens == engine.kv_capacity_tokens - fits * per_seq
    with pytest.raises(EngineFull, match="KV tokens"):
        engine.add_sequence("no-room", long, all_blocks(res), res.first_token, big)
    engine.abort("k0")
    engine.add_sequence("room", long, all_blocks(res), res.first_token, big)
    for i in range(1, fits):
        engine.abort(f"k{i}")
    engine.abort("room")
    assert engine.load().kv_used_tokens == 0


def test_add_sequence_verifies_blocks(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 150)
    res = engine.prefill(ids, [], GREEDY)
    blocks = all_blocks(res)
    bad = bytearray(blocks[2])
    bad[HEADER_SIZE + 7] ^= 0x10
    with pytest.raises(IntegrityError, match=r"block 2 of sequence 'bad'.*checksum"):
        engine.add_sequence("bad", ids, [*blocks[:2], bytes(bad)], res.first_token, GREEDY)
    with pytest.raises(IntegrityError, match="holds 64 tokens, expected 22"):
        engine.add_sequence("swap", ids, [blocks[0], blocks[1], blocks[0]], res.first_token,
                            GREEDY)
    with pytest.raises(InvalidArgument, match=r"needs 3 blocks \(2 full \+ 1 tail\), got 2"):
        engine.add_sequence("short", ids, blocks[:2], res.first_token, GREEDY)
    assert engine.load().running == 0 and engine.load().kv_used_tokens == 0
    engine.add_sequence("ok", ids, blocks, res.first_token, GREEDY)
    with pytest.raises(InvalidArgument, match="already running"):
        engine.add_sequence("ok", ids, blocks, res.first_token, GREEDY)
    with pytest.raises(InvalidArgument, match="first_token"):
        engine.add_sequence("tok", ids, blocks, 10**9, GREEDY)
    with pytest.raises(InvalidArgument, match="seq_id"):
        engine.add_sequence("", ids, blocks, res.first_token, GREEDY)
    engine.abort("ok")


def test_step_with_nothing_running_is_empty(engine: Engine) -> None:
    assert engine.step() == []


def test_decode_is_stable_across_aborts(fresh: Engine) -> None:
    """Aborting one sequence mid-batch leaves the others' tokens untouched."""
    engine = fresh
    ids = engine.chat_tokens(FRANCE)
    expect, _, _ = generate(engine, ids, GREEDY)
    res = engine.prefill(ids, [], GREEDY)
    engine.add_sequence("keep", ids, all_blocks(res), res.first_token, GREEDY)
    engine.add_sequence("drop", ids, all_blocks(res), res.first_token, GREEDY)
    got = [res.first_token]
    for step in range(30):
        if step == 2:
            engine.abort("drop")
        for o in engine.step():
            if o.seq_id == "keep":
                got.append(o.token_id)
    assert got == expect


def test_decode_alone_helper_matches_generate(fresh: Engine) -> None:
    engine = fresh
    ids = prompt(engine, 64)
    res = engine.prefill(ids, [], GREEDY)
    tokens, _, reason = decode_alone(engine, "x", ids, all_blocks(res), res.first_token, GREEDY)
    assert tokens == generate(engine, ids, GREEDY)[0] and reason in ("stop", "length")


def test_store_checked_blocks_skip_only_the_payload_hash(fresh: Engine) -> None:
    """`payload_checked` (bytes the store verified as it read them): the header, layout,
    token count and sizes are still checked; only the payload is not hashed again."""
    engine = fresh
    ids = prompt(engine, 150)
    res = engine.prefill(ids, [], GREEDY)
    blocks = all_blocks(res)
    bad_header = bytearray(blocks[1])
    bad_header[20] ^= 0x01
    with pytest.raises(IntegrityError, match=r"block 1 of sequence 'h'.*header checksum"):
        engine.add_sequence("h", ids, [blocks[0], bytes(bad_header), blocks[2]],
                            res.first_token, GREEDY, payload_checked=True)
    with pytest.raises(IntegrityError, match="holds 64 tokens, expected 22"):
        engine.add_sequence("swap", ids, [blocks[0], blocks[1], blocks[0]], res.first_token,
                            GREEDY, payload_checked=True)
    with pytest.raises(IntegrityError, match="block 2 of sequence 'cut'"):
        engine.add_sequence("cut", ids, [*blocks[:2], blocks[2][:-4]], res.first_token,
                            GREEDY, payload_checked=True)
    assert engine.load().kv_used_tokens == 0
    params = SamplingParams(temperature=0, max_tokens=6)
    alone, _, _ = generate(engine, ids, params)
    engine.add_sequence("ok", ids, blocks, res.first_token, params, payload_checked=True)
    got = [res.first_token]
    while engine.has_sequence("ok"):
        got += [o.token_id for o in engine.step()]
    assert got == alone


def test_released_kv_memory_is_reused_with_identical_tokens(fresh: Engine) -> None:
    """A sequence admitted into the memory a finished one left (its stale KV beyond the new
    prompt included) decodes exactly what a cold run decodes."""
    engine = fresh
    params = SamplingParams(temperature=0, max_tokens=8)
    long_ids, short_ids = prompt(engine, 200), prompt(engine, 150, variant=3)
    for seq_id, ids in (("long", long_ids), ("short", short_ids), ("again", long_ids)):
        res = engine.prefill(ids, [], params)
        alone, _, _ = generate(engine, ids, params)
        engine.add_sequence(seq_id, ids, all_blocks(res), res.first_token, params)
        got = [res.first_token]
        while engine.has_sequence(seq_id):
            got += [o.token_id for o in engine.step()]
        assert got == alone, seq_id
    assert engine.load().kv_used_tokens == 0
