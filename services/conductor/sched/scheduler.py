"""The scheduling decision: which prefill and which decode instance, or a 429. Pure.

`Scheduler.decide` is Mooncake's Algorithm 1 and the baselines it is measured against
(`policies`), over a typed view of the cluster (`PrefillView`, `DecodeView`) and the global KV
index; it does no I/O, so the live Conductor (`serving.router.MooncakeRouter`) and the trace
simulator (`tools.sim`) run exactly this code, and its tests need no servers.

"Local" is per host: an instance's mask (`PrefillView.local_mask`, `DecodeView.local_mask`)
is every segment on its host, so a prefix on the instance's host costs the cost model's `local`
link and one elsewhere its `pool` link (measured between hosts by `mooncake calibrate`); the
fetch-or-recompute choice (`_cost_global`) is then the network's.

When the global-cache-aware policy fetches, the blocks are kept where they were fetched to
(hot-block replication): the next request with that prefix finds it on one more host. The
cache-aware policies also prefer, load permitting, the decode instance whose host holds the
prompt's reused prefix (`_near_decode`): a repeat then moves only its new tail between hosts.
With early rejection, the decision is then judged against the SLOs (`admission.judge`) using
the predicted TTFT and the TBT predicted from the decode load the request will meet.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.conductor.sched.admission import (
    AdmissionConfig,
    DecodeLedger,
    Verdict,
    judge,
)
from mooncake_k8s.conductor.sched.costmodel import CostModel
from mooncake_k8s.conductor.sched.kvindex import KVIndex, Match
from mooncake_k8s.conductor.sched.policies import POLICIES, Policy, picks

__all__ = ["POLICIES", "Decision", "DecodeView", "Demand", "Policy", "PrefillView",
           "Scheduler", "SchedulerConfig", "paired"]


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Policy | str = Policy.GLOBAL_CACHE_AWARE
    """A `Policy` or its name (the name is checked and turned into the enum)."""
    block_tokens: int = BLOCK_TOKENS
    """Tokens per KV block (the cluster's; the simulator uses the trace's)."""
    admission: AdmissionConfig | None = None
    """None: admit everything (no early rejection)."""
    replicate_min_blocks: int = 1
    """Keep a local replica of a fetched prefix only when at least this many blocks were
    fetched; raise it to spend local DRAM only on long shared prefixes."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        object.__setattr__(self, "policy", Policy(self.policy))
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.replicate_min_blocks < 1:
            raise ValueError("replicate_min_blocks must be >= 1")


@dataclass(slots=True)
class Demand:
    """What one request asks for, as the scheduler sees it."""

    keys: Sequence[Hashable]
    """Block keys of the prompt's full blocks, in order."""
    prompt_tokens: int
    max_tokens: int
    """Output tokens to plan for (the request's limit: the scheduler cannot know more)."""
    priority: str = "interactive"
    block_tokens: int = 0
    """Tokens per block of `keys` (the prefill engine's, from its load report); 0: the
    scheduler's configured size."""
    seed: int = 0
    """A number from the request itself (the live router's `request_seed`): the random
    policy draws from it and the configured seed, so replicas draw alike."""


@dataclass(slots=True)
class PrefillView:
    slot: int
    """Stable id of the instance (KV index masks and ledgers are keyed by it)."""
    queue_ms: float
    """Predicted time until a new request would start computing here."""
    local_mask: int = 0
    """KV index mask of the segments on this instance's host (0: it holds nothing locally)."""
    revision: str = ""
    """The deployment revision it runs: paired only with decode instances of the same one."""
    group_size: int = 1
    """Stages of the target: 1 for a single instance, G for a pipelined prefill group (its
    leader), whose compute time is the cost model's entry for G (`CostModel.prefill_for`)."""


@dataclass(slots=True)
class DecodeView:
    slot: int
    running: int = 0
    """Sequences the instance reports running (0 when unknown)."""
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    """0 = unknown: the cost model's capacity applies (or none)."""
    revision: str = ""
    """The deployment revision it runs (see `PrefillView.revision`)."""
    local_mask: int = 0
    """KV index mask of the segments on this instance's host: the prompt's KV held there is
    loaded without crossing the network (0: unknown, no locality preference)."""


@dataclass(slots=True)
class Decision:
    prefill: int
    """Index into the `prefills` given to `decide` (not the slot)."""
    decode: int
    local_blocks: int
    """Leading blocks the chosen prefill instance holds itself."""
    fetch_blocks: int
    """Further blocks it is to fetch from the pool (0 unless global-cache-aware)."""
    cached_tokens: int
    ttft_ms: float
    tbt_ms: float
    replicate: bool
    verdict: Verdict
    match: Match

    @property
    def admitted(self) -> bool:
        return self.verdict.admit


class Scheduler:
    """One policy, its RNG and round-robin state, and the decode ledger. Not thread-safe:
    the live Conductor calls it from its event loop only.

    Deterministic for equal state: ties go to the first candidate (the live router lists
    them in address order), and the random policy draws from the request's `Demand.seed`,
    so Conductor replicas that see the same instances, reports and index choose alike.
    Round robin is the exception: its rotation is each replica's own."""

    def __init__(self, config: SchedulerConfig, model: CostModel, index: KVIndex) -> None:
        self.config = config
        self.model = model
        self.index = index
        self.ledger = DecodeLedger()
        self.block_tokens = config.block_tokens
        """Of the decision under way: `Demand.block_tokens`, else the configured size."""
        self._rng = random.Random(config.seed)
        self._prefill_pick, self._decode_pick = picks(Policy(config.policy), self._rng)
        self._reseed = Policy(config.policy) is Policy.RANDOM
        self._locality = Policy(config.policy) in (Policy.LOCAL_CACHE_AWARE,
                                                    Policy.GLOBAL_CACHE_AWARE)
        """Whether decode is picked with the prompt's KV in mind (`_near_decode`)."""
        self._memo: dict[tuple[int, int, int, int, int, bool, int], tuple[float, int]] = {}
        self._memo_model: CostModel | None = None

    # -- pieces ----------------------------------------------------------------------------

    def _tokens(self, blocks: int, prompt: int) -> int:
        """Cached tokens for a prefix of `blocks`; at least one prompt token is computed
        (its logits give the first output token)."""
        return max(0, min(blocks * self.block_tokens, prompt - 1))

    def cost_local(self, local: int, prompt: int, group: int = 1) -> float:
        """Loading the local prefix and computing the rest on a target of `group` stages."""
        m = self.model
        c = self._tokens(local, prompt)
        return m.transfer_ms("local", c) + m.prefill_ms(prompt - c, c, group)

    def _cost_global(self, local: int, match: Match, prompt: int,
                     group: int = 1) -> tuple[float, int]:
        """Best of computing past the local prefix or fetching the pool's longer prefix:
        (ms, blocks fetched)."""
        own = self.cost_local(local, prompt, group)
        g = match.global_blocks
        if g <= local:
            return own, 0
        m = self.model
        c_local = self._tokens(local, prompt)
        c_dram = self._tokens(max(local, match.dram_blocks), prompt)
        c_all = self._tokens(g, prompt)
        fetched = (m.transfer_ms("local", c_local) + m.remote_ms(c_dram - c_local)
                   + m.transfer_ms("ssd", c_all - c_dram)
                   + m.prefill_ms(prompt - c_all, c_all, group))
        return (fetched, g - local) if fetched < own else (own, 0)

    def costs(self, lengths: set[int], match: Match, prompt: int,
              glob: bool, group: int = 1) -> dict[int, tuple[float, int]]:
        """(ms, blocks fetched) per distinct local prefix length among the candidates (all
        of `group` stages: a group's compute time is its own, `CostModel.prefill_for`).

        Memoised: the candidates share a handful of lengths, and consecutive prompts the same
        few (length, match, prompt) combinations, so most decisions evaluate no cost model at
        all. The memo is dropped when the model or the block size changes, and when it grows
        past `_COSTS_MEMO` entries."""
        memo = self._memo
        bt = self.block_tokens
        if self._memo_model is not self.model:
            memo.clear()
            self._memo_model = self.model
        g, dram = match.global_blocks, match.dram_blocks
        out: dict[int, tuple[float, int]] = {}
        for li in lengths:
            key = (li, g, dram, prompt, bt, glob, group)
            c = memo.get(key)
            if c is None:
                c = (self._cost_global(li, match, prompt, group) if glob
                     else (self.cost_local(li, prompt, group), 0))
                if len(memo) >= _COSTS_MEMO:
                    memo.clear()
                memo[key] = c
            out[li] = c
        return out

    # -- the decision ----------------------------------------------------------------------

    def decide(self, demand: Demand, prefills: Sequence[PrefillView],
               decodes: Sequence[DecodeView], now_ms: float, *, shed: bool = True) -> Decision:
        """Choose (prefill, decode) for one request; record it in the ledger if admitted.

        A prefill instance is paired only with decode instances of its revision (`paired`).
        `shed=False` admits whatever the prediction says (a resumed stream, which the client
        is already reading, is never refused); the choice is made the same way."""
        if not prefills or not decodes:
            raise ValueError("decide needs at least one prefill and one decode instance")
        self.block_tokens = demand.block_tokens or self.config.block_tokens
        if self._reseed and demand.seed:
            # Equal state and request, equal choice (N replicas): the draws depend on both.
            self._rng.seed(self.config.seed << 32 ^ demand.seed)
        prompt = demand.prompt_tokens
        pi, ttft, fetch, local, match = self._pick_prefill(demand, prefills, decodes)
        reuse = local + fetch
        cached = self._tokens(reuse, prompt)
        self.ledger.expire(now_ms)
        di, tbt, fits, clears = self._pick_decode(demand, decodes, prefills[pi].revision,
                                                  now_ms + ttft, reuse)
        adm = self.config.admission
        verdict = (judge(adm, demand.priority, ttft, tbt, fits, clears)
                   if adm is not None and shed else Verdict(True))
        if verdict.admit:
            out = max(0, demand.max_tokens - 1)
            finish = now_ms + ttft + out * tbt
            self.ledger.add(decodes[di].slot, finish, prompt + demand.max_tokens)
        return Decision(pi, di, local, fetch, cached, ttft, tbt,
                        fetch >= self.config.replicate_min_blocks, verdict, match)

    def _pick_prefill(self, demand: Demand, prefills: Sequence[PrefillView],
                      decodes: Sequence[DecodeView]) -> tuple[int, float, int, int, Match]:
        """(index, predicted TTFT, blocks to fetch, local blocks, the index's match).

        The policy picks among every instance; only when its pick has no decode instance of
        its revision (a rollout under way) does it pick again among those that have one, so
        the usual case costs one comparison. The match is then over those (`Decision.match`
        is over the candidates of the final pick)."""
        prompt = demand.prompt_tokens
        match = self.index.match(demand.keys, [p.local_mask for p in prefills])
        pi, ttft, fetch = self._prefill_pick(self, prefills, match, prompt)
        if paired(prefills[pi].revision, decodes):
            return pi, ttft, fetch, match.local_blocks[pi], match
        ok = [i for i, p in enumerate(prefills) if paired(p.revision, decodes)]
        if not ok:  # no revision in common: any pair beats refusing
            return pi, ttft, fetch, match.local_blocks[pi], match
        some = [prefills[i] for i in ok]
        match = self.index.match(demand.keys, [p.local_mask for p in some])
        si, ttft, fetch = self._prefill_pick(self, some, match, prompt)
        return ok[si], ttft, fetch, match.local_blocks[si], match

    def _state(self, d: DecodeView, t_ms: float) -> tuple[int, int, int]:
        """(sequences, reserved tokens, capacity) predicted for a decode instance at t."""
        seqs, toks = self.ledger.at(d.slot, t_ms)
        cap = d.kv_capacity_tokens or self.model.decode.kv_capacity_tokens
        return max(seqs, d.running), max(toks, d.kv_used_tokens), cap

    def _pick_decode(self, demand: Demand, decodes: Sequence[DecodeView], revision: str,
                     arrive_ms: float, reuse: int = 0) -> tuple[int, float, bool, float]:
        """(index, predicted TBT, KV fits, ms until its next predicted finish), among the
        instances of `revision` when there are any (picked again among those only when the
        first pick is of another revision: for the least-loaded policies the same answer).
        `reuse`: leading blocks of the prompt the prefill reuses (not computes), which the
        cache-aware policies would rather the decode found on its own host."""
        need = demand.prompt_tokens + demand.max_tokens
        di = self._decode_pick(self, decodes, need)
        if decodes[di].revision != revision:
            same = [i for i, d in enumerate(decodes) if d.revision == revision]
            if same:
                di = same[self._decode_pick(self, [decodes[i] for i in same], need)]
        if reuse and self._locality:
            di = self._near_decode(demand, decodes, di, reuse, arrive_ms)
        tbt, fits = self._predict(decodes[di], need, arrive_ms)
        clears = self.ledger.next_finish(decodes[di].slot) - arrive_ms
        return di, tbt, fits, max(0.0, clears)

    def _predict(self, d: DecodeView, need: int, arrive_ms: float) -> tuple[float, bool]:
        """(TBT, KV fits) predicted for a request of `need` tokens joining `d` at arrival."""
        n_seqs, n_toks, cap = self._state(d, arrive_ms)
        return self.model.step_ms(n_seqs + 1, n_toks + need), not cap or n_toks + need <= cap

    def _near_decode(self, demand: Demand, decodes: Sequence[DecodeView], di: int,
                     reuse: int, arrive_ms: float) -> int:
        """The load-based pick `di`, or a decode instance of its revision whose host holds
        more of the reused prefix, when that is cheaper for the request as a whole.

        Cost of an instance: loading the reused KV, once (what its host holds over the
        `local` link, the rest from another host: `CostModel.remote_ms`), plus the
        request's decode steps at the TBT it would see there. A holder never replaces a
        pick whose KV fits when its own does not, nor one within the TBT objective when its
        own TBT is over it and worse: locality only outweighs small differences of load,
        and the verdict is judged on the final pick as ever."""
        masks = [d.local_mask for d in decodes]
        if not any(masks):
            return di
        held = self.index.match(demand.keys, masks)
        if not any(held.local_blocks[j] > held.local_blocks[di] for j in held.holding):
            return di
        prompt = demand.prompt_tokens
        need = prompt + demand.max_tokens
        steps = max(0, demand.max_tokens - 1)
        cached = self._tokens(reuse, prompt)
        limit = self._tbt_limit(demand.priority)

        def cost(j: int) -> tuple[float, float, bool]:
            tbt, fits = self._predict(decodes[j], need, arrive_ms)
            near = self._tokens(min(held.local_blocks[j], reuse), prompt)
            load = self.model.transfer_ms("local", near) + self.model.remote_ms(cached - near)
            return load + steps * tbt, tbt, fits

        best = di
        best_ms, tbt0, fits0 = cost(di)
        rev = decodes[di].revision
        for j in held.holding:
            if held.local_blocks[j] <= held.local_blocks[di] or decodes[j].revision != rev:
                continue
            ms, tbt, fits = cost(j)
            if (fits0 and not fits) or (tbt > limit and tbt > tbt0):
                continue
            if ms < best_ms or (ms == best_ms and held.local_blocks[j] > held.local_blocks[best]):
                best, best_ms = j, ms  # a tie goes to the holder: less over the network
        return best

    def _tbt_limit(self, priority: str) -> float:
        """The TBT a request of this class may be predicted to see and be admitted."""
        adm = self.config.admission
        if adm is None or adm.slo.tbt_ms is None:
            return math.inf
        return adm.slo.tbt_ms * adm.fraction(priority)


def paired(revision: str, decodes: Sequence[DecodeView]) -> bool:
    """Whether a prefill instance of `revision` can be paired: some decode instance runs the
    same revision (during a rollout, a request never mixes two; another revision may be
    another model). Stops at the first match: O(1) outside rollouts."""
    return any(d.revision == revision for d in decodes)


_COSTS_MEMO = 4096
