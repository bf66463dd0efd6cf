"""vLLM behind the engine seam (`engine.api`): prefill and decode through a vLLM server.

Prefill→decode handoff goes through the pool: prefill asks its vLLM for one token; the KV
connector saves the prompt's full blocks to the store (in the plan's write segment, next to the
decode) before vLLM answers. Decode asks its vLLM to continue `prompt + first token`; its
connector loads those blocks and vLLM computes only the partial tail block (< block_tokens
tokens) and the first token. Chosen over vLLM's two-phase `kv_transfer_params` P2P protocol
because the blocks then stay in the pool: any later prefill on any node reuses them, and a
decode instance that dies can be replaced by another that loads the same blocks.

The plan reaches the connector inside the request (`kv_transfer_params["mooncake"]`): keys the
Conductor computed, how many leading blocks the pool holds, where to write (`write_segment`,
next to the decode, and `home_segment`, this prefill's own host: one replica on each), and where
to keep blocks read from another host (`keep_on`: the plan's `keep_fetched` on prefill, the
decode work's `keep_on` on decode). Tenants: the tenant
salts our keys and, as vLLM's `cache_salt`, vLLM's own prefix cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.adapter import ChildEngine, ChildSettings, kv_load, with_cache_salt
from mooncake_k8s.engine.api import (
    DecodeWork,
    EngineContext,
    EngineCounter,
    EngineFailed,
    EngineInfo,
    EngineLoad,
    PrefillDone,
    PrefillWork,
    TokenOut,
)
from mooncake_k8s.engine.loading import dir_tokenizer_fingerprint, model_source
from mooncake_k8s.engine.vllm.connector import PARAMS_KEY
from mooncake_k8s.engine.vllm.server import VllmError, VllmServer, VllmServerConfig


def sampling_body(s: pb.Sampling, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": s.temperature,
                            "top_p": s.top_p if s.top_p > 0 else 1.0,
                            "ignore_eos": s.ignore_eos, "skip_special_tokens": True}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.has_seed:
        body["seed"] = s.seed
    return body


class _Vllm(ChildEngine):
    server: VllmServer

    def __init__(self, ctx: EngineContext) -> None:
        settings = ctx.settings_as(ChildSettings)
        path, fp, name = model_source(ctx.model, progress=False)
        super().__init__(VllmServer(VllmServerConfig(
            model_dir=path, served_name=name, fingerprint=fp.hex(),
            block_tokens=ctx.model.block_tokens, master=ctx.master, token=ctx.token,
            role=ctx.role, extra_args=list(settings.args), transport=ctx.transport,
            ready_timeout_s=settings.ready_timeout_s,
        )))
        ident = self.server.identity
        self.info = EngineInfo("vllm", name, fp.hex(), str(ident["dtype"]),
                               int(ident["block_tokens"]), self.server.max_model_len,
                               str(ident["kv_layout"]),
                               tokenizer_fingerprint=dir_tokenizer_fingerprint(path))

    def counters(self) -> list[EngineCounter]:
        """What the KV connector in vLLM's processes did: blocks moved by outcome, and how
        requests learnt what the pool holds (the plan, or a lookup of its own)."""
        stats = self.server.connector_stats()
        out = [EngineCounter("mooncake_vllm_kv_blocks_total",
                             "KV blocks the vLLM connector moved, by outcome",
                             float(stats.get(k, 0)), {"outcome": k})
               for k in ("loaded", "rejected", "missing", "saved", "save_failed")]
        out += [EngineCounter("mooncake_vllm_pool_queries_total",
                              "Requests whose pool prefix came from the plan or a lookup",
                              float(stats.get(k, 0)), {"source": k})
                for k in ("planned", "lookups")]
        out += [EngineCounter("mooncake_vllm_kv_save_layers_total",
                              "Layers of saved blocks copied out of vLLM's cache: in the "
                              "layer's own hook (hooked) or after the forward pass (late)",
                              float(stats.get(f"layers_{k}", 0)), {"when": k})
                for k in ("hooked", "late")]
        out.append(EngineCounter("mooncake_vllm_kv_blocks_streamed_total",
                                 "Saved blocks written layer by layer while vLLM computed",
                                 float(stats.get("streamed", 0))))
        return out

    def read_load(self, metrics: str) -> EngineLoad:
        """vLLM's gauges; the KV capacity is a label of `vllm:cache_config_info`."""
        vals: dict[str, float] = {}
        cap = 0
        for fam in text_string_to_metric_families(metrics):
            for smp in fam.samples:
                if smp.name == "vllm:cache_config_info":
                    cap = int(smp.labels.get("kv_cache_size_tokens", "0") or 0)
                else:
                    vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
        return kv_load(vals.get("vllm:num_requests_running", 0),
                       vals.get("vllm:num_requests_waiting", 0), cap,
                       vals.get("vllm:kv_cache_usage_perc", 0.0))

    def _body(self, tokens: list[int], tenant: str, params: dict[str, Any]) -> dict[str, Any]:
        return with_cache_salt({"model": self.info.served_name, "prompt": tokens,
                                "return_token_ids": True,
                                "kv_transfer_params": {PARAMS_KEY: {**params, "tenant": tenant}}},
                               tenant)


class VllmPrefill(_Vllm):
    def prefill(self, work: PrefillWork) -> PrefillDone:
        plan = work.plan
        params: dict[str, Any] = {"keys": list(plan.keys), "write_segment": plan.write_segment,
                                  "home_segment": plan.home_segment}
        if plan.keep_fetched and plan.home_segment:
            params["keep_on"] = plan.home_segment  # what it reads from another host stays here
        if plan.planned:
            params["reuse"] = plan.reuse_blocks
        body = {**self._body(work.token_ids, work.tenant, params),
                **sampling_body(work.sampling, 1)}
        t0 = time.monotonic()
        try:
            out = self.server.complete(body)
        except (OSError, VllmError) as e:
            raise self.error(e) from e
        choice = out["choices"][0]
        ids = choice.get("token_ids") or []
        if not ids:
            raise EngineFailed("vLLM returned no token")
        reason = choice.get("finish_reason")
        # "length" is our own max_tokens=1; the request goes on unless it asked for one token.
        finished = reason == "stop" or (reason == "length" and work.sampling.max_tokens <= 1)
        usage = out.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return PrefillDone(
            first_token=int(ids[0]), text=choice.get("text", ""), finished=finished,
            finish_reason=(reason or "") if finished else "", cached_tokens=cached,
            computed_tokens=len(work.token_ids) - cached, compute_s=time.monotonic() - t0)


class VllmDecode(_Vllm):
    def decode(self, work: DecodeWork, cancelled: threading.Event) -> Iterator[TokenOut]:
        left = work.sampling.max_tokens - 1
        if left <= 0:
            return
        params: dict[str, Any] = {"keys": list(work.keys), "reuse": len(work.keys),
                                  "save": False}
        if work.keep_on:
            params["keep_on"] = work.keep_on
        body = {**self._body([*work.token_ids, work.first_token], work.tenant, params),
                **sampling_body(work.sampling, left)}
        stream = self.server.stream_completion(body)
        last_id = work.first_token
        try:
            for chunk in stream:
                if cancelled.is_set():
                    return
                for choice in chunk.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    reason = choice.get("finish_reason")
                    text = choice.get("text", "")
                    for i, tid in enumerate(ids):
                        last = i == len(ids) - 1
                        last_id = int(tid)
                        yield TokenOut(int(tid), text if last else "",
                                       finished=last and reason is not None,
                                       finish_reason=reason if last else None)
                    if not ids and reason is not None:  # a stop string ended it: no new token
                        yield TokenOut(last_id, text, True, reason)
        except (OSError, VllmError) as e:
            raise self.error(e) from e
        finally:
            stream.close()

