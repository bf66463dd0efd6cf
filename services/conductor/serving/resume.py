"""Decode failover, the pure part: what a stream resumed on another decode instance asks for.

When a decode instance dies mid-stream, the Conductor resumes the stream elsewhere: it sends the
original prompt plus every token the client already has as the new prompt (prefill reads the
prompt's blocks from the pool, which keeps a copy outside the dead decode, and recomputes the
rest), with the same seed and a `max_tokens` cut by what was already produced. The engine's
sampler draws the token at absolute position p from a generator seeded with (seed, p), so
the resumed run samples exactly what the undisturbed one would have; with temperature 0 it is
greedy and the text is the same.

A drained decode (SIGTERM) hands a stream over instead (`HandedOff`): its last message says
its KV is in the pool (the context's full blocks under the usual keys, the partial last block
as `tail_key`). The stream then *continues* on another decode instance of the same revision
with no prefill call: the context is the prompt plus every streamed token but the last, and the
last one is the new call's `first_token` (`continued_prompt`, `continued_sampling`), so at most
the tail block's tokens are ever recomputed (none: the tail is loaded too).

The pipeline (`pipeline.Pipeline`) runs the resume; these functions are what tests call.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from mooncake_k8s.common.errors import MooncakeError
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.serving.instances import Instance

INT63 = (1 << 63) - 1


class DecodeLost(MooncakeError):
    """The decode instance serving a stream failed after the client saw output: the stream
    is resumed on another instance, or ends with an error event when none is left."""

    def __init__(self, instance: Instance, message: str) -> None:
        super().__init__(message)
        self.instance = instance
        self.revision = instance.report.revision if instance.report else ""
        self.at = time.monotonic()
        """When the failure was detected: the resume latency starts here."""


class HandedOff(DecodeLost):
    """A draining decode handed the stream over (`DecodeChunk.handoff`): its KV is in the
    pool and the stream continues on another instance without a prefill call."""

    def __init__(self, instance: Instance, handoff: pb.DecodeHandoff) -> None:
        super().__init__(instance, f"decode instance {instance.instance_id} handed the "
                                   f"stream over ({handoff.reason or 'no reason given'})")
        self.handoff = handoff


def with_seed(sampling: pb.Sampling) -> pb.Sampling:
    """A sampled request without a seed gets one here, once, for its whole life.

    Prefill, decode and any resumed decode then draw from one seed, so a resume continues the
    same random sequence (without this each process would pick its own seed and a resumed
    stream would be a different, equally valid, sample). Greedy requests need none.
    """
    if sampling.has_seed or sampling.temperature <= 0:
        return sampling
    out = pb.Sampling()
    out.CopyFrom(sampling)
    out.has_seed, out.seed = True, secrets.randbelow(INT63)
    return out


def resumed_prompt(prompt: Sequence[int], streamed: Sequence[int]) -> list[int]:
    """The prompt a resumed stream sends: the original one, then every token the client has
    (their KV is rebuilt: the prompt's from the pool, the streamed tokens' by recomputing)."""
    return [*prompt, *streamed]


def resumed_sampling(sampling: pb.Sampling, produced: int) -> pb.Sampling:
    """The same sampling parameters (seed included) with `max_tokens` cut by the tokens
    already produced, so the stream ends where the undisturbed one would.

    Raises ValueError when nothing is left to produce: the caller must not resume a stream
    that had already produced all it may.
    """
    if produced >= sampling.max_tokens:
        raise ValueError(f"{produced} tokens produced of max_tokens={sampling.max_tokens}: "
                         "nothing left to resume")
    out = pb.Sampling()
    out.CopyFrom(sampling)
    out.max_tokens = sampling.max_tokens - produced
    return out


def continued_prompt(prompt: Sequence[int], streamed: Sequence[int]) -> tuple[list[int], int]:
    """(context, next token) of a handed-over stream: the context is every token whose KV the
    draining decode stored (prompt + streamed[:-1]); the last streamed token's KV is not
    computed yet, exactly as a prefill's `first_token`. Raises ValueError with nothing
    streamed (there is no next token to continue from)."""
    if not streamed:
        raise ValueError("nothing was streamed: there is no token to continue from")
    return [*prompt, *streamed[:-1]], streamed[-1]


def continued_sampling(sampling: pb.Sampling, streamed: int) -> pb.Sampling:
    """A continuation's sampling: the new call's `first_token` is the last streamed token and
    counts toward `max_tokens` (as a prefill's does), so `streamed - 1` are already produced
    and the stream still ends where the undisturbed one would. Same seed."""
    return resumed_sampling(sampling, streamed - 1)


def handoff_mismatch(handoff: pb.DecodeHandoff, prompt: int, streamed: int) -> str:
    """Why a handoff cannot be continued as sent ("" when it can): the decode's context must be
    exactly what the Conductor has (prompt + streamed - 1 tokens); any other count means the
    stored KV is not this stream's, and the stream takes the failover path (re-prefill)."""
    want = prompt + streamed - 1
    if streamed < 1:
        return "handoff before any token was streamed"
    if handoff.context_tokens != want:
        return (f"handoff says {handoff.context_tokens} context tokens, the stream has "
                f"{want}")
    return ""


def resume_candidates(usable: Sequence[Instance], revision: str) -> list[Instance]:
    """Instances a stream may resume on: usable ones of the lost instance's revision (another
    revision may be another model, whose text would differ). A dead instance is not usable
    (the pipeline marks it failed); one that refused (KV missing) may serve the resume."""
    return [i for i in usable if i.report is not None and i.report.revision == revision]


def resume_request_id(request_id: str, resume: int) -> str:
    """A fresh id per resume: the failed instance may still hold the old sequence (a live
    instance that refused, rather than a dead one), and ids must not collide there."""
    return f"{request_id}-r{resume}"

