"""Prompts for the serving benchmark: synthetic shared prefixes, Mooncake traces, reuse probes.

Prompts are token ids, not text, for the completions endpoint: the server takes them as they
are, so a prompt has exactly the length we asked for and two prompts share exactly the prefix we
built into them (text would go through a tokenizer whose merges can move the boundary). Ids
0-16 are the model's special tokens and are never drawn. For the chat endpoint, which only takes
text, every id is rendered as one short common word ("id % len(WORDS)"): a shared id prefix
becomes a shared text prefix, and lengths are close to (not exactly) the token count; the
server's `usage.prompt_tokens` gives the real number in the results.

Content is random but reproducible: everything is drawn from `numpy.random.default_rng` seeded
by (`seed`, `salt`). The seed fixes the structure, the salt fixes the bytes; the benchmark picks
a fresh salt per run unless told one, so a second run against the same long-lived server never
hits KV cached by the first and the measured hit rate is the workload's own.
"""

from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve.client import RequestSpec

FIRST_ID = 17  # ids below this are special tokens in SmolLM2's vocabulary
DEFAULT_VOCAB = 49152
TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids each cover 512 prompt tokens
_WORD_TEXT = (
    "the of and to in is was for on with as by at from that this which are be or an it his "
    "were had not but have their they one all been has her can more will there when who also "
    "its new first two time after into other some only than over most would these many where "
    "made such through under what years any part may then well used could city world long "
    "them later each work both between life state three during since about known people year "
    "those water being small number house great while high power line name form just music "
    "game place film school found like set down team back left way area early same before "
    "good end own side made home four five light land make group around still much family "
    "last film book main field play local second war river church best five open order art "
    "air north south east west town love stone tree road rain fire song blue green red gold"
)
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))  # de-duplicated, order kept


@dataclass
class Dataset:
    """The requests of one run plus what is known about them before sending any."""

    requests: list[RequestSpec]
    info: dict[str, Any] = field(default_factory=dict)


def new_salt() -> int:
    return secrets.randbits(31)


def render(ids: np.ndarray | list[int], endpoint: str) -> list[int] | str:
    """Token ids for completions; one common word per id for chat (see the module docstring)."""
    if endpoint == "chat":
        return " ".join(WORDS[int(i) % len(WORDS)] for i in ids)
    return [int(i) for i in ids]


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(FIRST_ID, vocab, size=n, dtype=np.int64)


def ideal_hit_rate(groups: list[tuple[str, int]], block_tokens: int) -> float:
    """Cached share of prompt tokens with an unbounded cache: every prefix after its first use.

    `groups` is (prefix key, shared prefix tokens) per request in send order; only full blocks
    of the shared prefix can be reused, as on the server.
    """
    seen: set[str] = set()
    cached = 0
    total = 0
    for key, n in groups:
        total += n
        if key in seen:
            cached += (n // block_tokens) * block_tokens
        seen.add(key)
    return cached / total if total else 0.0


def synthetic(*, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
              output_len: int, seed: int, salt: int, endpoint: str,
              vocab: int = DEFAULT_VOCAB, block_tokens: int = 64) -> Dataset:
    """`num_prefixes` random shared prefixes, each request one of them plus its own suffix.

    Requests are spread evenly over the prefixes and then shuffled, so the first use of every
    prefix (the unavoidable miss) lands anywhere in the run, as in vLLM's prefix-repetition set.
    """
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    rng = np.random.default_rng([seed, salt])
    prefixes = [random_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    order = [i % num_prefixes for i in range(num_prompts)]
    np.random.default_rng(seed).shuffle(order)
    requests = []
    for k in order:
        ids = np.concatenate([prefixes[k], random_ids(rng, suffix_len, vocab)])
        requests.append(RequestSpec(prompt=render(ids, endpoint), prompt_len=len(ids),
                                    output_len=output_len, tag=f"prefix{k}"))
    usage = [(f"p{k}", prefix_len) for k in order]
    hit = ideal_hit_rate(usage, block_tokens) * (
        num_prompts * prefix_len / max(1, num_prompts * (prefix_len + suffix_len)))
    return Dataset(requests, {
        "dataset": "synthetic", "num_prompts": num_prompts, "prefix_len": prefix_len,
        "suffix_len": suffix_len, "num_prefixes": num_prefixes, "output_len": output_len,
        "ideal_prefix_cache_hit_rate": hit})


class _BlockTable:
    """hash_id -> a fixed block of token ids, so equal hash_ids become equal token runs."""

    def __init__(self, block_len: int, seed: int, salt: int, vocab: int) -> None:
        self.block_len = block_len
        self.seed = seed
        self.salt = salt
        self.vocab = vocab
        self._blocks: dict[int, np.ndarray] = {}

    def get(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, self.salt, int(hash_id)])
            block = self._blocks[hash_id] = random_ids(rng, self.block_len, self.vocab)
        return block


def trace(path: str | Path, *, num_prompts: int, scale: float, time_scale: float,
          start: int, max_model_len: int, seed: int, salt: int, endpoint: str,
          vocab: int = DEFAULT_VOCAB) -> Dataset:
    """Rows `start .. start+num_prompts` of a Mooncake JSONL trace, scaled for a small model.

    Lengths are divided by `scale` (the CPU model cannot prefill 100K tokens) and every 512-token
    hash block becomes a block of 512/scale token ids, drawn once per hash_id: prompts that share
    leading hash_ids share exactly that token prefix, so the trace's reuse pattern survives the
    scaling. Arrival times (ms in the trace) are kept relative to the first row and multiplied
    by `time_scale` (> 1 spreads the load out). A prompt that would not fit the context with its
    output is cut at the end (its prefix, the part that can be shared, is kept) and counted.
    """
    if scale <= 0 or time_scale < 0:
        raise ValueError("--trace-scale must be > 0 and --trace-time-scale >= 0")
    block_len = max(1, round(TRACE_BLOCK_TOKENS / scale))
    table = _BlockTable(block_len, seed, salt, vocab)
    requests: list[RequestSpec] = []
    usage: list[tuple[str, int]] = []
    clamped = 0
    first_ts: float | None = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(itertools.islice(f, start, start + num_prompts), start):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts = float(row["timestamp"])
                hash_ids = [int(h) for h in row["hash_ids"]]
                in_len = int(row["input_length"])
                out_len = int(row["output_length"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno + 1}: not a Mooncake trace row ({e})") from e
            first_ts = ts if first_ts is None else first_ts
            output_len = max(1, round(out_len / scale))
            prompt_len = max(1, min(round(in_len / scale), block_len * len(hash_ids)))
            room = max_model_len - output_len - 1
            if prompt_len > room:
                prompt_len = max(1, room)
                clamped += 1
            ids = np.concatenate([table.get(h) for h in hash_ids] or [np.zeros(0, np.int64)])
            ids = ids[:prompt_len]
            if len(ids) < prompt_len:  # a row without hash_ids: unique filler
                filler = random_ids(np.random.default_rng([seed, salt, -1 - lineno]),
                                    prompt_len - len(ids), vocab)
                ids = np.concatenate([ids, filler])
            requests.append(RequestSpec(
                prompt=render(ids, endpoint), prompt_len=prompt_len, output_len=output_len,
                arrival_s=(ts - first_ts) / 1000.0 * time_scale, tag=f"row{lineno}"))
            # Reuse in the trace is per leading hash block; credit what the scaled prompt keeps.
            for i in range(len(hash_ids)):
                n = min(block_len, prompt_len - i * block_len)
                if n <= 0:
                    break
                usage.append((",".join(map(str, hash_ids[: i + 1])), n))
    if not requests:
        raise ValueError(f"{path}: no rows in [{start}, {start + num_prompts})")
    return Dataset(requests, {
        "dataset": "trace", "trace": str(path), "num_prompts": len(requests),
        "trace_start": start, "trace_scale": scale, "trace_time_scale": time_scale,
        "trace_block_len": block_len, "clamped_to_context": clamped,
        "mean_prompt_len": float(np.mean([r.prompt_len for r in requests])),
        "mean_output_len": float(np.mean([r.output_len for r in requests])),
        "span_s": requests[-1].arrival_s or 0.0,
        "ideal_prefix_cache_hit_rate": _trace_ideal(usage)})


def _trace_ideal(usage: list[tuple[str, int]]) -> float:
    """Ideal hit rate of a trace, counted per hash block (the server's cache granularity,
    `block_tokens`, rounds this down a little when a scaled hash block is not a multiple of it).
    """
    seen: set[str] = set()
    cached = total = 0
    for key, n in usage:
        total += n
        if key in seen:
            cached += n
        seen.add(key)
    return cached / total if total else 0.0


def fresh_prompt(n: int, endpoint: str, vocab: int = DEFAULT_VOCAB) -> list[int] | str:
    """A prompt nobody has sent before (OS randomness): the cold half of a reuse probe."""
    rng = np.random.default_rng(secrets.randbits(64))
    return render(random_ids(rng, n, vocab), endpoint)
