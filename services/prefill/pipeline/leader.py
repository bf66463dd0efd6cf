"""Stage 0 of a prefill group: a `Prefill` call run through the whole group.

The leader follows the Conductor's plan as a single instance does, but every stage reads the
reused prefix (its own layers of each whole block) and the group recomputes from the shortest
prefix any stage verified. The leader leases the new blocks' space (`open_put`) and sends the
lease plan down, so each stage writes its layers of every new block straight into the
replicas; it then computes chunk after chunk through its own layers and hands each to the next
stage without waiting for it (the pipeline), takes the last hidden state back from the last
stage, and finishes as `Engine.prefill` does (`EmbeddedStage.complete`: logits, sampling, the
other stages' byte ranges read back, headers, commit). Any failure of another stage raises
`StageFailed`: the call fails UNAVAILABLE and the Conductor retries it elsewhere.
"""

from __future__ import annotations

import time

import torch

from mooncake_k8s.common import tracing
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import PrefillDone, PrefillWork
from mooncake_k8s.prefill.pipeline.config import chunk_tokens_for
from mooncake_k8s.prefill.pipeline.group import StageClock, StageRuntime
from mooncake_k8s.prefill.pipeline.inbox import StageFailed, tensor_from
from mooncake_k8s.prefill.pipeline.link import Downstream


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) cut at absolute multiples of `chunk` (as a single instance cuts it)."""
    out: list[tuple[int, int]] = []
    a = start
    while a < end:
        b = min((a // chunk + 1) * chunk, end)
        out.append((a, b))
        a = b
    return out


class Leader:
    """Runs prompts through the group (on the worker's engine thread, one at a time)."""

    def __init__(self, rt: StageRuntime) -> None:
        self.rt = rt

    def prefill(self, work: PrefillWork) -> tuple[PrefillDone, list[pb.StageStats]]:
        rt = self.rt
        try:
            down = rt.open_downstream()
        except StageFailed as e:
            rt.failed(e)
            raise
        try:
            return self._run(work, down)
        except StageFailed as e:
            rt.stage.abort()
            rt.failed(e)
            raise
        except BaseException:
            rt.stage.abort()
            raise
        finally:
            down.close()

    def _reuse(self, work: PrefillWork) -> list[str]:
        """The leading keys every stage reads: the plan's, or the stored prefix without one."""
        plan = work.plan
        n = plan.reuse_blocks if plan.planned else self._lookup(list(plan.keys))
        return list(plan.keys[:n])

    def _lookup(self, keys: list[str]) -> int:
        if not keys:
            return 0
        try:
            return int(self.rt.worker.store.prefix_len(keys))
        except Exception:
            return 0

    def _run(self, work: PrefillWork, down: Downstream) -> tuple[PrefillDone,
                                                                  list[pb.StageStats]]:
        rt, stage = self.rt, self.rt.stage
        t0 = time.monotonic()
        reuse = self._reuse(work)
        plan = work.plan
        down.begin(pb.StageBegin(request_id=work.request_id, token_ids=work.token_ids,
                                 reuse_keys=reuse, keep_fetched=plan.keep_fetched,
                                 trace_context=work.trace))
        keep_on = plan.home_segment if plan.keep_fetched else ""
        with tracing.span("prefill.group.load_kv", reuse_blocks=len(reuse)):
            verified = stage.begin(work.request_id, work.token_ids, reuse, keep_on)
            first_block = stage.recompute_from([verified, down.wait_begun()])
        start = first_block * rt.adapter.info.block_tokens
        put_plan = stage.open_put(work, first_block)
        down.start(pb.StageStart(start=start, first_block=first_block, put_plan=put_plan))
        t1 = time.monotonic()
        clock = StageClock()
        with tracing.span("prefill.group.compute", start=start):
            size = chunk_tokens_for(len(work.token_ids) - start, stage.engine.chunk_tokens,
                                    rt.chunk_tokens, rt.chunks)
            for a, b in chunk_bounds(start, len(work.token_ids), size):
                with clock.timed():
                    h = stage.forward(a, b, None)
                down.send(h, a, b)
            if stage.needs_last_token_pass():
                n = len(work.token_ids)
                with clock.timed():
                    h = stage.last_token_pass(None)
                down.send(h, n - 1, n, last_pass=True)
            result = down.finish()
        t2 = time.monotonic()
        lo, hi = rt.layers(0)
        mine = clock.stats(0, lo, hi, bytes_out=down.bytes_out)
        last = tensor_from(result.last_hidden, _dtype(result.dtype, rt.dtype), 1)
        ranges = list(zip(result.layer_ranges[::2], result.layer_ranges[1::2], strict=True))
        with tracing.span("prefill.group.store_kv"):
            done = stage.complete(work, last, ranges, list(result.failed_objects))
        mine.kv_bytes = int(stage.kv_bytes)
        rt.metrics.account(mine)
        done.load_s, done.compute_s = t1 - t0, t2 - t1
        done.store_s = time.monotonic() - t2
        return done, [mine, *result.stages]


def _dtype(name: str, default: torch.dtype) -> torch.dtype:
    got = getattr(torch, name, None) if name else None
    return got if isinstance(got, torch.dtype) else default
