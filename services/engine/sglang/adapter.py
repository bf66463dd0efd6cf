"""SGLang behind the engine seam (`engine.api`): prefill and decode through SGLang servers.

Handoff is SGLang's own PD protocol, paired by the Conductor's plan: both sides get the prefill
instance's bootstrap address and one room number, and the same request body. The decode server
allocates KV pages and tells the prefill server (over SGLang's control plane) where they are;
the prefill server computes the prompt, reusing pages from our pool through HiCache, and writes
the KV straight into the decode server's pages with our transfer engine. The prefill side
returns the first token; the decode side streams every token, and this adapter passes on those
after the first (the first reached the client from prefill already).

Chosen over the pool handoff vLLM uses: it is what SGLang users run in production (and what
Mooncake's engine serves there), the bytes cross the network once, and the prompt's full pages
still land in the pool, written through by the prefill instance's HiCache for any later reuse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.adapter import ChildEngine, kv_load, with_cache_salt
from mooncake_k8s.engine.api import (
    DecodeWork,
    EngineContext,
    EngineCounter,
    EngineFailed,
    EngineInfo,
    EngineLoad,
    ModelConfig,
    PrefillDone,
    PrefillWork,
    TokenOut,
)
from mooncake_k8s.engine.loading import dir_tokenizer_fingerprint, model_source
from mooncake_k8s.engine.sglang.kind import SglangSettings
from mooncake_k8s.engine.sglang.server import SglangError, SglangServer, SglangServerConfig

HICACHE_OUTCOMES = ("pages_loaded", "pages_missed", "pages_saved", "save_failed")


def sampling_params(s: pb.Sampling) -> dict[str, Any]:
    p: dict[str, Any] = {"max_new_tokens": s.max_tokens, "temperature": s.temperature,
                         "top_p": s.top_p if s.top_p > 0 else 1.0,
                         "ignore_eos": s.ignore_eos, "skip_special_tokens": True}
    if s.stop:
        p["stop"] = list(s.stop)
    if s.has_seed:
        p["sampling_seed"] = s.seed
    return p


def finish_reason(meta: dict[str, Any]) -> str | None:
    """SGLang's finish reason as OpenAI names it; raises for an aborted request."""
    fr = meta.get("finish_reason")
    if not fr:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    if kind == "abort":
        msg = fr.get("message", "aborted") if isinstance(fr, dict) else "aborted"
        status = fr.get("status_code", 500) if isinstance(fr, dict) else 500
        if isinstance(status, int) and 400 <= status < 500:
            raise InvalidArgument(f"SGLang refused the request: {msg}")
        raise EngineFailed(f"SGLang aborted the request: {msg}")
    return "length" if kind == "length" else "stop"


def _device(model: ModelConfig) -> str:
    if model.device:
        return "cpu" if model.device == "cpu" else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class _Sglang(ChildEngine):
    server: SglangServer

    def __init__(self, ctx: EngineContext) -> None:
        settings = ctx.settings_as(SglangSettings)
        path, fp, name = model_source(ctx.model, progress=False)
        super().__init__(SglangServer(SglangServerConfig(
            model_dir=path, served_name=name, fingerprint=fp.hex(),
            page_tokens=ctx.model.block_tokens, master=ctx.master, token=ctx.token,
            role=ctx.role, host=ctx.host, advertise_host=ctx.advertise_host,
            device=_device(ctx.model), bootstrap_port=settings.bootstrap_port,
            pd_port=settings.pd_port, sidecar=settings.sidecar,
            extra_args=list(settings.args), transport=ctx.transport,
            ready_timeout_s=settings.ready_timeout_s,
        )))
        s = self.server
        self.info = EngineInfo("sglang", name, fp.hex(), s.dtype, ctx.model.block_tokens,
                               s.max_context, s.kv_layout, s.bootstrap_addr,
                               dir_tokenizer_fingerprint(path))

    def counters(self) -> list[EngineCounter]:
        """What our HiCache backend and transfer engine in SGLang's processes did."""
        stats = self.server.connector_stats()
        out = [EngineCounter("mooncake_sglang_hicache_pages_total",
                             "HiCache pages SGLang moved through our pool, by outcome",
                             float(stats.get(k, 0)), {"outcome": k.removeprefix("pages_")})
               for k in HICACHE_OUTCOMES]
        out += [EngineCounter("mooncake_sglang_pd_transfer_bytes_total",
                              "KV bytes our transfer engine moved for SGLang PD handoff",
                              float(stats.get("pd_bytes", 0))),
                EngineCounter("mooncake_sglang_pd_transfer_failures_total",
                              "PD transfer batches that failed (SGLang fails the request over)",
                              float(stats.get("pd_failed", 0)))]
        return out

    def read_load(self, metrics: str) -> EngineLoad:
        """SGLang's gauges (summed over its processes' samples)."""
        vals: dict[str, float] = {}
        for fam in text_string_to_metric_families(metrics):
            for smp in fam.samples:
                vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
        return kv_load(vals.get("sglang:num_running_reqs", 0),
                       vals.get("sglang:num_queue_reqs", 0),
                       vals.get("sglang:max_total_num_tokens", 0),
                       vals.get("sglang:token_usage", 0.0))

    def _body(self, tokens: list[int], tenant: str, sampling: pb.Sampling, addr: str,
              room: int) -> dict[str, Any]:
        if not addr or not room:
            raise InvalidArgument(
                "an SGLang worker hands KV over in pairs: this request carries no bootstrap "
                "address and room (the Conductor sets them when it pairs SGLang instances)")
        host, _, port = addr.rpartition(":")
        return with_cache_salt({"input_ids": tokens, "sampling_params": sampling_params(sampling),
                                "bootstrap_host": host.strip("[]"), "bootstrap_port": int(port),
                                "bootstrap_room": room}, tenant)


class SglangPrefill(_Sglang):
    def prefill(self, work: PrefillWork) -> PrefillDone:
        plan = work.plan
        body = self._body(work.token_ids, work.tenant, work.sampling, plan.bootstrap_addr,
                          plan.bootstrap_room)
        t0 = time.monotonic()
        try:
            out = self.server.generate(body)
        except (OSError, SglangError) as e:
            raise self.error(e) from e
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids") or []
        if not ids:
            raise EngineFailed("SGLang prefill returned no token")
        reason = finish_reason(meta)
        # Prefill always stops after one token; the request ends there only if that token
        # ended it (a stop) or one token was all it asked for.
        finished = reason == "stop" or work.sampling.max_tokens <= 1
        cached = int(meta.get("cached_tokens") or 0)
        return PrefillDone(
            first_token=int(ids[0]), text=str(out.get("text", "")), finished=finished,
            finish_reason=(reason or "length") if finished else "", cached_tokens=cached,
            computed_tokens=len(work.token_ids) - cached, compute_s=time.monotonic() - t0)


class SglangDecode(_Sglang):
    def decode(self, work: DecodeWork, cancelled: threading.Event) -> Iterator[TokenOut]:
        body = {**self._body(work.token_ids, work.tenant, work.sampling, work.bootstrap_addr,
                             work.bootstrap_room), "stream": True}
        stream = self.server.stream("/generate", body)
        seen = 0  # output tokens so far (the first is prefill's, already sent)
        text_seen = ""
        try:
            for chunk in stream:
                if cancelled.is_set():
                    return
                meta = chunk.get("meta_info") or {}
                ids = [int(t) for t in chunk.get("output_ids") or ()]
                total = int(meta.get("completion_tokens") or 0)
                new = ids[seen:] if len(ids) == total else ids  # cumulative or incremental
                text = str(chunk.get("text", ""))
                reason = finish_reason(meta)
                start = seen
                seen += len(new)
                if start == 0 and new:  # the first token: prefill's, already streamed
                    new = new[1:]
                    if not new:
                        text_seen = text
                        if reason is not None and work.sampling.max_tokens > 1:
                            yield TokenOut(ids[-1], "", True, reason)
                        continue
                delta, text_seen = text[len(text_seen):], text
                for i, tid in enumerate(new):
                    last = i == len(new) - 1
                    yield TokenOut(tid, delta if last else "",
                                   finished=last and reason is not None,
                                   finish_reason=reason if last else None)
                if not new and reason is not None:  # ended without a new token
                    yield TokenOut(ids[-1] if ids else 0, delta, True, reason)
        except (OSError, SglangError) as e:
            raise self.error(e) from e
        finally:
            stream.close()

