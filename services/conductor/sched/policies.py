"""The scheduling policies: one enum naming them, one small class per way of picking.

A policy is a pair of pickers, one for the prefill instance and one for the decode instance
(`picks`). `Scheduler.decide` calls them and does the rest (ledger, SLO judgement) the same way
for every policy, so adding a policy is a class here and a row in `picks`, never another
branch in the scheduler.

- `random`, `round_robin`: ignore load and cache (prefill and decode alike).
- `load_balancing`: the prefill instance with the shortest predicted queue.
- `local_cache_aware`: least `queue + load(local prefix) + prefill(rest)`.
- `global_cache_aware` (Mooncake's Algorithm 1): also considers fetching the longest prefix
  held anywhere in the pool.

Every policy but the two blind ones picks decode by the least predicted step-time load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from enum import StrEnum
from itertools import compress
from typing import TYPE_CHECKING, Protocol

from mooncake_k8s.conductor.sched.admission import DecodeLedger
from mooncake_k8s.conductor.sched.kvindex import Match

if TYPE_CHECKING:
    from mooncake_k8s.conductor.sched.scheduler import DecodeView, PrefillView, Scheduler


class Policy(StrEnum):
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LOAD_BALANCING = "load_balancing"
    LOCAL_CACHE_AWARE = "local_cache_aware"
    GLOBAL_CACHE_AWARE = "global_cache_aware"


#: The policies' names, as the CLI and the CRD spell them.
POLICIES: tuple[str, ...] = tuple(p.value for p in Policy)


class PrefillPick(Protocol):
    def __call__(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        """(index into `prefills`, predicted TTFT in ms, blocks to fetch from the pool)."""


class DecodePick(Protocol):
    def __call__(self, s: Scheduler, decodes: Sequence[DecodeView], need: int) -> int:
        """Index into `decodes`."""


class RandomPrefill:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        pi = self.rng.randrange(len(prefills))
        return pi, prefills[pi].queue_ms + _own(s, prefills[pi], match, pi, prompt), 0


class RoundRobinPrefill:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        pi = self.next % len(prefills)
        self.next += 1
        return pi, prefills[pi].queue_ms + _own(s, prefills[pi], match, pi, prompt), 0


class LeastQueuePrefill:
    def __call__(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        pi = min(range(len(prefills)), key=lambda i: prefills[i].queue_ms)
        return pi, prefills[pi].queue_ms + _own(s, prefills[pi], match, pi, prompt), 0


class CacheAwarePrefill:
    """Least queue plus the cost of this prompt on each instance: its local prefix loaded,
    and (`pool`) the pool's longer prefix fetched where that is cheaper than computing."""

    def __init__(self, pool: bool) -> None:
        self.pool = pool

    def __call__(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        local = match.local_blocks
        held = match.holding
        if any(p.group_size > 1 for p in prefills):
            return self._grouped(s, prefills, match, prompt)
        lengths = {local[i] for i in held}
        if len(held) < len(local):
            lengths.add(0)
        costs = s.costs(lengths, match, prompt, self.pool)
        if len(costs) == 1:
            (only,) = costs.values()
            queues = [p.queue_ms for p in prefills]
            pi = queues.index(min(queues))
            return pi, queues[pi] + only[0], only[1]
        c0 = costs.get(0)
        if c0 is None:
            ms = {li: c[0] for li, c in costs.items()}
            totals = [p.queue_ms + ms[li] for p, li in zip(prefills, local, strict=True)]
        else:
            # Most candidates hold nothing of the prompt: add their one cost in a tight loop,
            # then redo the few that hold a prefix (the index lists them).
            z = c0[0]
            totals = [p.queue_ms + z for p in prefills]
            for i in held:
                totals[i] = prefills[i].queue_ms + costs[local[i]][0]
        ttft = min(totals)
        pi = totals.index(ttft)
        if totals.count(ttft) > 1:
            # A tie (a network no slower than a local load, as an uncalibrated profile may
            # say): the instance holding more of the prompt on its host moves less over it.
            pi = max((i for i, t in enumerate(totals) if t == ttft), key=local.__getitem__)
        return pi, ttft, costs[local[pi]][1]


    def _grouped(self, s: Scheduler, prefills: Sequence[PrefillView], match: Match,
                 prompt: int) -> tuple[int, float, int]:
        """The same choice among targets of several sizes (single instances and prefill
        groups): each target's cost uses its own size's prefill fit."""
        local = match.local_blocks
        lengths: dict[int, set[int]] = {}
        for p, li in zip(prefills, local, strict=True):
            lengths.setdefault(p.group_size, set()).add(li)
        costs = {g: s.costs(ls, match, prompt, self.pool, g) for g, ls in lengths.items()}
        totals = [p.queue_ms + costs[p.group_size][li][0]
                  for p, li in zip(prefills, local, strict=True)]
        ttft = min(totals)
        pi = totals.index(ttft)
        if totals.count(ttft) > 1:
            pi = max((i for i, t in enumerate(totals) if t == ttft), key=local.__getitem__)
        return pi, ttft, costs[prefills[pi].group_size][local[pi]][1]


def _own(s: Scheduler, p: PrefillView, match: Match, pi: int, prompt: int) -> float:
    """The picked target's cost of this prompt past its local prefix (its size's fit)."""
    return s.cost_local(match.local_blocks[pi], prompt, p.group_size)


class RandomDecode:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, s: Scheduler, decodes: Sequence[DecodeView], need: int) -> int:
        return self.rng.randrange(len(decodes))


class RoundRobinDecode:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self, s: Scheduler, decodes: Sequence[DecodeView], need: int) -> int:
        di = self.next % len(decodes)
        self.next += 1
        return di


class LeastLoadedDecode:
    """Rank by the ledger's current totals (the batch-size and context terms of the step
    time; the rest is the same for every instance), then the scheduler looks exactly at the
    winner: an exact prediction for every instance would cost a bisection each."""

    def __call__(self, s: Scheduler, decodes: Sequence[DecodeView], need: int) -> int:
        led = s.ledger
        dm = s.model.decode
        if led.weights != (dm.per_seq_ms, dm.per_ctx_token_ms):
            led.weigh(dm.per_seq_ms, dm.per_ctx_token_ms)
        try:
            return least_loaded(decodes, led, dm.kv_capacity_tokens, need)
        except IndexError:  # a slot the ledger has not seen yet
            led.ensure(max(d.slot for d in decodes) + 1)
            return least_loaded(decodes, led, dm.kv_capacity_tokens, need)


def picks(policy: Policy, rng: random.Random) -> tuple[PrefillPick, DecodePick]:
    """The (prefill, decode) pickers of a policy; the blind ones share the scheduler's RNG."""
    if policy is Policy.RANDOM:
        return RandomPrefill(rng), RandomDecode(rng)
    if policy is Policy.ROUND_ROBIN:
        return RoundRobinPrefill(), RoundRobinDecode()
    prefill: dict[Policy, PrefillPick] = {
        Policy.LOAD_BALANCING: LeastQueuePrefill(),
        Policy.LOCAL_CACHE_AWARE: CacheAwarePrefill(pool=False),
        Policy.GLOBAL_CACHE_AWARE: CacheAwarePrefill(pool=True),
    }
    return prefill[policy], LeastLoadedDecode()


def least_loaded(decodes: Sequence[DecodeView], ledger: DecodeLedger, dcap: int,
                 need: int) -> int:
    """Index of the decode instance with the least step-time load, ranked by the ledger's
    current totals or the instance's report, whichever is larger (the batch-size and context
    terms of the step time; the rest is the same for every instance). A full instance is
    chosen only if every instance is full; ties go to the first. Raises IndexError for a slot
    beyond the ledger.

    The ledger's own load is a lower bound of each instance's (a report only raises it; the
    weights are >= 0), so only the instances whose bound is within the load of the first one
    with the least bound can win: those are ranked exactly, in order; the rest are not looked
    at. When that first one's rank is its bound, it wins outright.
    """
    ps, pc = ledger.weights
    seqs, toks = ledger.seqs, ledger.tokens
    load = ledger.load
    bounds = [load[d.slot] for d in decodes]  # a comprehension: faster than map here (3.11)
    first = bounds.index(min(bounds))
    bar = _decode_load(decodes[first], seqs, toks, ps, pc, dcap, need)
    if bar == bounds[first]:
        # Its rank is its bound, the least bound, and no instance before it has that bound:
        # nothing can rank lower, and a tie goes to the first (the common case).
        return first
    best = math.inf
    di = 0
    for i in compress(range(len(bounds)), map(bar.__ge__, bounds)):
        if bounds[i] >= best:
            continue  # cannot be strictly less than the best so far
        d = decodes[i]
        slot = d.slot
        s = seqs[slot]
        if d.running > s:
            s = d.running
        t = toks[slot]
        if d.kv_used_tokens > t:
            t = d.kv_used_tokens
        cap = d.kv_capacity_tokens or dcap
        v = ps * s + pc * t
        if cap and t + need > cap:
            v += 1e18  # full: only if every instance is
        if v < best:
            best, di = v, i
    return di


def _decode_load(d: DecodeView, seqs: list[int], toks: list[int], ps: float, pc: float,
                 dcap: int, need: int) -> float:
    """One instance's rank in `least_loaded` (the same arithmetic as its loop)."""
    slot = d.slot
    s = max(seqs[slot], d.running)
    t = max(toks[slot], d.kv_used_tokens)
    cap = d.kv_capacity_tokens or dcap
    v = ps * s + pc * t
    return v + 1e18 if cap and t + need > cap else v
