"""Helpers for driving an engine by hand: prompts of exact lengths, prefill-then-decode, and the
block list decode needs after a prefill.

Shipped in the package (like `kopf.testing`) so the engine's tests, the serving tests and
benchmarks all run a request through an engine the same way the services do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mooncake_k8s.engine.embedded.engine import Engine
from mooncake_k8s.engine.embedded.structs import PrefillResult, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)

_TEXT = """\
Mooncake serves large language models by keeping the key-value cache of every prompt it has
seen in a pool of memory spread over many machines. When a request arrives, the scheduler
looks for the longest prefix of its prompt whose cache blocks already exist, loads those
blocks, and computes only what is new. Section {i}: the prefill pool turns prompts into cache
blocks, the decode pool turns cache blocks into tokens, and the store keeps the blocks between
them. Operators like it because a repeated system prompt costs almost nothing the second time.
"""


def prompt_tokens(engine: Engine, n: int, variant: int = 0) -> list[int]:
    """Exactly n tokens of English text; another `variant` gives another text."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        chunk = "".join(_TEXT.format(i=j + 1000 * variant) for j in range(i, i + 40))
        ids += engine.encode(chunk)
        i += 40
    return ids[:n]


def all_blocks(res: PrefillResult, imported: Sequence[Any] = ()) -> list[Any]:
    """What decode needs after a prefill: the imported blocks it used, the new ones, the tail."""
    blocks = list(imported[: len(imported) - res.rejected_blocks])
    blocks += [b for _, b in res.new_blocks]
    if res.tail_block is not None:
        blocks.append(res.tail_block)
    return blocks


def decode_alone(
    engine: Engine,
    seq_id: str,
    ids: list[int],
    blocks: list[Any],
    first: int,
    params: SamplingParams,
) -> tuple[list[int], str, str | None]:
    """Run one sequence to its end with nothing else running: its tokens (the first included),
    the text after the first token, and the finish reason."""
    engine.add_sequence(seq_id, ids, blocks, first, params)
    tokens, text, reason = [first], "", None
    while engine.has_sequence(seq_id):
        for out in engine.step():
            if out.seq_id == seq_id:
                tokens.append(out.token_id)
                text += out.text
                reason = out.finish_reason
    return tokens, text, reason


def generate(
    engine: Engine, ids: list[int], params: SamplingParams, seq_id: str = "g"
) -> tuple[list[int], str, str | None]:
    """A cold prefill, then decode alone: every token, the whole text, the finish reason."""
    res = engine.prefill(ids, [], params, seq_id=seq_id)
    if res.finished:
        return [res.first_token], res.text, res.finish_reason
    tokens, text, reason = decode_alone(
        engine, seq_id, ids, all_blocks(res), res.first_token, params
    )
    return tokens, res.text + text, reason


def poison_scratch(engine: Engine) -> None:
    """Fill the engine's prefill buffer with NaN, so KV an import failed to write shows up."""
    with torch.inference_mode():
        if engine._scratch is not None:
            engine._scratch.fill_(float("nan"))
