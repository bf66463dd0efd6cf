"""Token sampling: greedy, temperature and nucleus (top_p), reproducible across processes.

Prefill samples a request's first token and a decode instance, in another process, samples
the rest. For a seeded request to give the same tokens every time, the random draw for the
token at position p may depend only on (seed, p) and the logits, never on how many tokens this
process sampled before or which other sequences share the batch. So every draw uses a fresh
CPU generator seeded with a hash of (seed, position).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from mooncake_k8s.engine.embedded.structs import SamplingParams


def random_seed() -> int:
    """A seed for requests that gave none (different in every process, by design)."""
    return secrets.randbits(63)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position` of a request seeded with `seed`."""
    data = f"{seed}:{position}".encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"mooncake-smpl").digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Sample from float32 logits [vocab] (any device; the draw happens on the CPU)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().to("cpu", torch.float32) / params.temperature
    probs = torch.softmax(x, dim=-1)
    gen = torch.Generator().manual_seed(position_seed(seed, position))
    if params.top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=gen))
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[before >= params.top_p] = 0.0  # the top token always survives (before = 0)
    pick = int(torch.multinomial(sorted_probs, 1, generator=gen))
    return int(order[pick])


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """One token per row of logits [B, vocab]; greedy rows share one argmax call."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, tok in zip(greedy, torch.argmax(rows, dim=-1).tolist(), strict=True):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, seeds[i], positions[i])
    return out
