"""`MooncakeK8sConnector`: vLLM's KV connector (v1) backed by our store and transfer engine.

vLLM loads it by module path (`--kv-transfer-config`, `kv_connector_module_path`), once in the
scheduler process (role SCHEDULER) and once per worker (role WORKER):

- Scheduler side: for a new request, how many leading prompt tokens the pool can supply beyond
  vLLM's own prefix cache. The count comes from the Conductor's plan when the request carries
  one (`kv_transfer_params["mooncake"]`: keys computed once by the Conductor, how many leading
  blocks the pool holds): the master is not asked again. Without a plan it asks the store once.
  Each step it tells the workers which pool blocks to load into which vLLM blocks, and which
  fully computed prompt blocks to save.
- Worker side: loads before the forward pass (every block verified by header and checksum; a
  bad or vanished block is reported to vLLM, which recomputes it: `kv_load_failure_policy`
  "recompute"). Saves layer by layer (`layersave`): vLLM calls `save_kv_layer` right after each
  attention layer has written its KV, and that layer's slice of every block the step saves is
  copied out of vLLM's cache and handed to a streaming put (store.client.streamput) whose
  sender thread writes it at the layer's offset of each block object on the plan's segments,
  while the next layers compute. `wait_for_save` then only adds the headers (the payload
  checksum needs every layer), sends them and commits; a block the stream could not store is
  put whole. The stored bytes are those of a whole-block save.

Keys: our chained block keys (DESIGN §3) in a namespace that includes the model fingerprint,
dtype, block size, tenant and the producer tag `vllm-<device>`, so vLLM blocks never stand in for
the embedded engine's (or another device's) and tenants never share.

Loads stay whole, before the forward pass, rather than per layer in `wait_for_layer_load`: the
store reads whole objects (every layer of a block in one), a block can only be trusted once its
checksum over all layers is checked, and layer 0 needs every block; so a per-layer load would
wait for the whole read before layer 0 and leave only the scatter into vLLM's cache (CPU work
on the same cores) to spread over the layers. Measured in docs/engines.md. A save returns when
committed: a prefill that answers has its blocks in the pool for decode to read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from mooncake_k8s.common.blocks import (
    HEADER_SIZE,
    BlockLayout,
    KeyNamespace,
    block_keys,
    decode_block,
)
from mooncake_k8s.common.errors import IntegrityError, MooncakeError, ObjectExists
from mooncake_k8s.engine.statsfile import stats_path, write_stats
from mooncake_k8s.engine.vllm.kvlayout import PagedKV, UnsupportedLayout, dtype_name
from mooncake_k8s.engine.vllm.layersave import (
    LayerSink,
    PutAtCommit,
    SaveGroup,
    StepSave,
    StreamSink,
)
from mooncake_k8s.engine.vllm.spin import limit_idle_spin

log = logging.getLogger("mooncake_k8s.vllm.connector")

PARAMS_KEY = "mooncake"
"""The key of our plan inside a request's `kv_transfer_params`."""
STAGING_PREFAULT = 256 << 20
"""The most host staging a worker prepares at registration (see `_buffer`)."""
_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass
class _Load:
    keys: list[str]
    block_ids: list[int]
    keep_on: str = ""
    """Blocks read from another host are kept on this segment (hot-block replication)."""


@dataclass
class MooncakeMeta(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[SaveGroup] = field(default_factory=list)


@dataclass
class _Req:
    keys: list[str]
    prompt_len: int
    pool_blocks: int
    """Leading blocks the pool holds (the plan's count, or the store's answer)."""
    segments: tuple[str, ...]
    """Where new blocks' replicas go, in order (empty: the store places one)."""
    save: bool
    keep_on: str = ""
    local_blocks: int = 0
    """Blocks vLLM's own prefix cache supplied (nothing to load for them)."""
    load_blocks: int = 0
    saved_upto: int = 0
    block_ids: list[int] = field(default_factory=list)


def kv_layout_tag(device_type: str) -> str:
    return f"vllm-{device_type}"


def _valid_keys(keys: Any, full: int) -> bool:
    """Plan keys we can use: a list of at most `full` 128-bit hex keys. Anything else (a
    hand-written request to the vLLM port) is ignored, never allowed to break the scheduler."""
    return (isinstance(keys, list) and len(keys) <= full
            and all(isinstance(k, str) and _KEY.fullmatch(k) for k in keys))


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _segments(params: dict[str, Any]) -> tuple[str, ...]:
    """New blocks' replicas: one on the prefill's own host (`home_segment`), one next to the
    decode (`write_segment`); the same segment or an empty one is one copy."""
    named = (_str(params.get("home_segment")), _str(params.get("write_segment")))
    return tuple(dict.fromkeys(s for s in named if s))


def _store_client(extra: dict[str, Any]) -> Any:
    from mooncake_k8s.store.client import StoreClient

    token = os.environ.get("MOONCAKE_CLUSTER_TOKEN", "")
    return StoreClient(extra["master"], token, transport=extra.get("transport", "auto"))


class MooncakeK8sConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        limit_idle_spin()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._bs = int(vllm_config.cache_config.block_size)
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
        self._dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        from vllm.platforms import current_platform

        self._layout_tag = kv_layout_tag(str(current_platform.device_type))
        self._fingerprint = str(extra["fingerprint"])
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._stats: dict[str, int] = {}
        self._stats_file = stats_path(extra.get("stats_prefix"),
                                      "scheduler" if role == KVConnectorRole.SCHEDULER
                                      else "worker")
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _Req] = {}
            self._stats.update(lookups=0, planned=0)
            self._write_identity(extra.get("identity_file"))
        else:
            self._paged: PagedKV | None = None
            self._layout: BlockLayout | None = None
            self._errors: set[int] = set()
            self._stats.update(loaded=0, rejected=0, missing=0, saved=0, save_failed=0,
                               layers_hooked=0, layers_late=0, streamed=0)
            self._staging = np.empty(0, dtype=np.uint8)
            self._step: tuple[MooncakeMeta, StepSave] | None = None
            self._stream_saves = extra.get("stream_saves", True) is not False

    # -- shared ----------------------------------------------------------------------------

    def _client(self) -> Any:
        with self._store_lock:
            if self._store is None:
                self._store = _store_client(self._extra)
            return self._store

    def _namespace(self, tenant: str) -> KeyNamespace:
        return KeyNamespace(self._fingerprint, self._dtype, self._bs, tenant_salt=tenant,
                            kv_layout=self._layout_tag)

    def _write_identity(self, path: str | None) -> None:
        """Tell the worker that started vLLM what our key namespace is made of."""
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"dtype": self._dtype, "block_tokens": self._bs,
                       "kv_layout": self._layout_tag}, f)
        os.replace(tmp, path)

    def shutdown(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()

    # -- scheduler side --------------------------------------------------------------------

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        prompt = list(request.prompt_token_ids or [])
        ktp = request.kv_transfer_params
        params = ktp.get(PARAMS_KEY) if isinstance(ktp, dict) else None
        if not isinstance(params, dict):
            params = {}
        tenant = str(params.get("tenant", ""))
        full = len(prompt) // self._bs
        given: Any = params.get("keys")
        if _valid_keys(given, full):
            # The plan's keys, extended (decode's prompt has one more token) from their chain.
            keys = list(given)
            if len(keys) < full:
                rest = block_keys(self._namespace(tenant), prompt[len(keys) * self._bs:],
                                  parent=keys[-1] if keys else None)
                keys += rest[: full - len(keys)]
        else:
            keys = block_keys(self._namespace(tenant), prompt)
        reuse = params.get("reuse")
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 0:
            reuse = None  # absent or malformed: ask the pool
        if reuse is not None:  # the plan says how much the pool holds: do not ask again
            pool = min(reuse, len(keys))
            self._stats["planned"] += 1
            self._flush_stats()
        else:
            pool = self._lookup(keys) if params.get("lookup", True) else 0
        st = _Req(keys, len(prompt), pool, _segments(params), bool(params.get("save", True)),
                  keep_on=_str(params.get("keep_on")))
        st.saved_upto = st.pool_blocks
        self._reqs[request.request_id] = st
        return st

    def _lookup(self, keys: list[str]) -> int:
        if not keys:
            return 0
        self._stats["lookups"] += 1
        self._flush_stats()
        try:
            return int(self._client().prefix_len(keys))
        except MooncakeError as e:
            log.warning("pool lookup failed; computing the prompt: %s", e)
            return 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local_blocks = num_computed_tokens // self._bs
        # At least one prompt token is computed: its logits give the next token.
        usable = min(st.pool_blocks, (st.prompt_len - 1) // self._bs)
        if usable * self._bs <= num_computed_tokens:
            return 0, False
        return usable * self._bs - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        st = self._state(request)
        st.load_blocks = num_external_tokens // self._bs

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeMeta:
        meta = MooncakeMeta()
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(st, meta)
            self._plan_save(st, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id],
                            meta)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                st.block_ids = list(new_ids[0])  # after preemption: the whole list again
            elif new_ids is not None:
                st.block_ids += list(new_ids[0])
            self._plan_load(st, meta)  # resumed after preemption: the pool again
            done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
            self._plan_save(st, done, meta)
        return meta

    def _plan_load(self, st: _Req, meta: MooncakeMeta) -> None:
        """Load what vLLM was promised (`update_state_after_alloc`) into the blocks it got."""
        if st.load_blocks:
            a, b = st.local_blocks, st.local_blocks + st.load_blocks
            meta.loads.append(_Load(st.keys[a:b], st.block_ids[a:b], st.keep_on))
            st.load_blocks = 0

    def _plan_save(self, st: _Req, computed: int, meta: MooncakeMeta) -> None:
        """Save the prompt blocks this step completes (and the pool lacks)."""
        if not st.save:
            return
        full = min(min(computed, st.prompt_len) // self._bs, len(st.keys), len(st.block_ids))
        if full > st.saved_upto:
            a = st.saved_upto
            meta.saves.append(SaveGroup(st.keys[a:full], st.block_ids[a:full], st.segments))
            st.saved_upto = full

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._paged = PagedKV.from_caches(kv_caches)
            p = self._paged
            self._layout = BlockLayout(bytes.fromhex(self._fingerprint), dtype_name(p.dtype),
                                       len(p.layers), p.kv_heads, p.head_dim)
        except UnsupportedLayout as e:
            log.error("KV connector off (vLLM computes everything): %s", e)
            self._paged = None
        else:
            log.info("KV connector on: %d layers, %d kv heads, head dim %d, %s layout",
                     len(p.layers), p.kv_heads, p.head_dim, p.kind)
            tokens = int(getattr(self._vllm_config.model_config, "max_model_len", 0) or 0)
            self._buffer(min(tokens // self._bs, STAGING_PREFAULT // self._block_bytes()))

    def _block_bytes(self) -> int:
        assert self._layout is not None
        return int(self._layout.block_bytes(self._bs))

    def _buffer(self, n: int) -> np.ndarray:
        """Host staging for `n` blocks, shared by the step's loads (done before the forward)
        and saves (staged during it, committed in `wait_for_save`). Kept across steps, grown
        by half again when short, and written once when made: a fresh buffer's first touch
        (page faults) cost more than the copy itself here (0.6 s for 66 MB on this VM),
        so it is paid at registration (the prompt length vLLM allows, within
        STAGING_PREFAULT) or at the growth, never again per step."""
        size = self._block_bytes()
        if self._staging.nbytes < n * size:
            self._staging = np.empty(max(n * size, self._staging.nbytes * 3 // 2), np.uint8)
            self._staging.fill(0)
        return self._staging[: n * size].reshape(n, size)

    def _payloads(self, buf: np.ndarray) -> torch.Tensor:
        """The payload part of staged blocks as [n, layer, k|v, head, token, dim]."""
        assert self._paged is not None
        flat = torch.from_numpy(buf[:, HEADER_SIZE:]).view(self._paged.dtype)
        return flat.view(buf.shape[0], *self._paged.block_shape())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._paged is None or not isinstance(meta, MooncakeMeta):
            for ld in getattr(meta, "loads", ()):
                self._errors.update(ld.block_ids)
            return
        for ld in meta.loads:
            self._load(ld)
        self._flush_stats()

    def _load(self, ld: _Load) -> None:
        assert self._paged is not None and self._layout is not None
        buf = self._buffer(len(ld.keys))
        try:
            if ld.keep_on:
                sizes = self._client().batch_get_into(ld.keys, list(buf), keep_on=ld.keep_on)
            else:
                sizes = self._client().batch_get_into(ld.keys, list(buf))
        except MooncakeError as e:
            log.warning("loading %d blocks failed; vLLM recomputes them: %s", len(ld.keys), e)
            sizes = [None] * len(ld.keys)
        good = 0
        for i, size in enumerate(sizes):
            if size is None:
                self._stats["missing"] += 1
                break
            try:
                header, _ = decode_block(buf[i, :size], self._layout)
                if header.tokens != self._bs:
                    raise IntegrityError(f"block holds {header.tokens} tokens, not {self._bs}")
            except IntegrityError as e:
                self._stats["rejected"] += 1
                log.warning("block %s failed verification (%s); recomputing it", ld.keys[i], e)
                with contextlib.suppress(MooncakeError):  # let a fresh copy replace it
                    self._client().remove([ld.keys[i]], force=True)
                break
            good += 1
        if good:
            self._paged.scatter(ld.block_ids[:good], self._payloads(buf[:good]))
            self._stats["loaded"] += good
        self._errors.update(ld.block_ids[good:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in `start_load_kv` (see the module docstring for why)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Stage this layer's slice of every block the step saves (layersave)."""
        step = self._step_save()
        if step is not None and step.layer(layer_name):
            self._stats["layers_hooked"] += 1

    def _step_save(self) -> StepSave | None:
        """This step's saves, begun at the first hook (or at `wait_for_save` without hooks)."""
        meta = self._get_connector_metadata()
        if self._paged is None or not isinstance(meta, MooncakeMeta) or not meta.saves:
            return None
        if self._step is not None:
            if self._step[0] is meta:
                return self._step[1]
            self._step[1].sink.abort()  # a step that never reached wait_for_save
        assert self._layout is not None
        staging = self._buffer(sum(len(g.keys) for g in meta.saves))
        step = StepSave(self._paged, self._layout, self._bs, meta.saves, staging,
                        self._sink(meta.saves, staging))
        self._step = (meta, step)
        return step

    def _sink(self, groups: list[SaveGroup], staging: np.ndarray) -> LayerSink:
        """Stream the layers to the store as they are staged, or put whole blocks at the end
        (streaming switched off, or the streaming put could not start)."""
        if self._stream_saves:
            try:
                return StreamSink.open(self._client(), groups, staging, self._put)
            except (ImportError, MooncakeError) as e:
                log.warning("streaming saves off (blocks are put whole): %s", e)
                self._stream_saves = False
        return PutAtCommit(self._put)

    def wait_for_save(self) -> None:
        step = self._step_save()
        self._step = None
        if step is None:
            return
        self._stats["layers_late"] += step.layers - step.staged_layers
        results = step.finish()
        if isinstance(step.sink, StreamSink):
            self._stats["streamed"] += step.sink.streamed
        for g, errors in zip(step.groups, results, strict=True):
            for key, err in zip(g.keys, errors, strict=True):
                if err is None or isinstance(err, ObjectExists):
                    self._stats["saved"] += 1
                else:
                    self._stats["save_failed"] += 1
                    log.warning("saving block %s failed: %s", key, err)
        self._flush_stats()

    def _put(self, keys: list[str], objects: list[np.ndarray], segments: tuple[str, ...]
             ) -> list[Exception | None]:
        """One batched put: a replica on each of `segments`, or one the store places."""
        try:
            if len(segments) > 1:
                out: list[Exception | None] = self._client().batch_put(
                    keys, objects, segments=list(segments))
                return out
            seg = segments[0] if segments else None
            out = self._client().batch_put(
                keys, objects, placement="preferred" if seg else "local_first",
                preferred_segment=seg)
            return out
        except MooncakeError as e:
            return [e] * len(keys)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _flush_stats(self) -> None:
        """Counters for the worker process that started vLLM (it exports them as metrics):
        one small file per vLLM process, replaced whole."""
        write_stats(self._stats_file, self._stats)
