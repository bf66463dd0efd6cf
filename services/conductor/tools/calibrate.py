"""`mooncake calibrate`: measure a running deployment and write its cost model.

Everything is measured through the deployment's OpenAI endpoint, the way users see it:

- prefill: one-token completions of fresh random prompts of several lengths (cold), then of the
  same prompts extended by a suffix (warm: their prefix is cached; the response's
  `usage.prompt_tokens_details.cached_tokens` says exactly how much). Fitting latency against
  (new, cached) tokens gives the prefill model, and the per-cached-token cost that is left over
  is the load cost, i.e. the pool link's bandwidth once divided into the KV bytes per token.
- decode: groups of concurrent streams with `ignore_eos`, timing the token intervals while
  every stream of a group is running; the `X-Mooncake-Decode` header says which instance
  served each stream, so the batch size is counted per instance.
- prefill groups (chunked pipeline-parallel prefill): when the Conductor lists groups among
  its prefill targets (`GET /v1/instances`), the same prefill samples are taken once per kind
  of target, pinned with `X-Mooncake-Prefill-Group-Size` (1: single instances, G: groups of G),
  and each group size's fit is written to `prefill_groups[G]`. With no single instance, the
  smallest group's fit is also `prefill` (said in `extra`).
- KV bytes per token: given, or read from the store's block events (`--master`): the size of a
  stored block over its tokens.
- the links (with `--master`, unless `--no-links`): the KV links between hosts, measured
  through the store (`links`): `transfer.pool` from segments on other hosts, `transfer.local`
  from this host's. Without them the pool link is the end-to-end load cost above, which on
  one host is a same-host load. `--links-only` measures just these into a base profile.

Prompts are token ids (no tokeniser on this side), drawn from a seeded RNG below 10,000, which
every model's vocabulary covers; every prompt starts with a fresh random block so nothing of a
previous run is cached.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import numpy as np

from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.conductor.sched.costmodel import (
    PIPELINE_CHUNK_TOKENS,
    PIPELINE_CHUNKS,
    CostModel,
    CostModelError,
    Decode,
    Link,
    Prefill,
    fit_decode,
    fit_group_prefill,
    fit_prefill,
)
from mooncake_k8s.conductor.tools import links as links_mod

HEADER_BYTES = 64  # the KV block header (common.blocks.HEADER_SIZE)
GROUP_HEADER = "X-Mooncake-Prefill-Group-Size"
"""Pins a request's prefill to targets of that many stages (the Conductor's API)."""
Samples = list[tuple[int, int, float]]
"""(new tokens, cached tokens, ms) per request."""


class CalibrationError(RuntimeError):
    """The deployment could not be measured (unreachable, errors, too few samples)."""


@dataclass(frozen=True)
class CalibrateConfig:
    url: str
    api_key: str | None = None
    model: str | None = None
    lengths: Sequence[int] = (64, 128, 256, 512, 1024)
    suffix_tokens: int = 64
    batches: Sequence[int] = (1, 2, 4, 8)
    decode_context: Sequence[int] = (64, 512)
    decode_tokens: int = 32
    repeats: int = 2
    kv_bytes_per_token: int | None = None
    master: str | None = None
    token: str = ""
    block_tokens: int = BLOCK_TOKENS
    name: str = "calibrated"
    seed: int = 0
    timeout_s: float = 120.0
    """Per request: a stream that stops producing tokens fails the run instead of hanging."""
    links: bool = True
    """With `master`: measure the links between hosts into `transfer` (`links.measure`)."""
    link_sizes: Sequence[int] = links_mod.SIZES
    link_repeats: int = 3
    groups: bool = True
    """Measure the prefill groups among the targets, each size into `prefill_groups`."""
    group_chunk_tokens: int = PIPELINE_CHUNK_TOKENS
    """The groups' largest pipeline chunk (their workers' --pipeline-chunk-tokens): where the
    group fit's fill term stops growing."""
    group_chunks: int = PIPELINE_CHUNKS
    """Chunks the groups' workers cut a prompt into (--pipeline-chunks; 0 = fixed chunks)."""


class _Client:
    def __init__(self, cfg: CalibrateConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.session = session
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"
        self.model = cfg.model or ""

    async def discover(self) -> None:
        async with self.session.get(f"{self.cfg.url}/v1/models", headers=self.headers) as r:
            if r.status != 200:
                raise CalibrationError(f"GET /v1/models: HTTP {r.status}: {await r.text()}")
            data = (await r.json())["data"]
        if not data:
            raise CalibrationError("the deployment serves no model yet (not ready?)")
        if not self.model:
            self.model = data[0]["id"]

    async def target_sizes(self) -> set[int]:
        """Stages of the ready prefill targets (1: single instances, G: groups of G), from
        the Conductor's listing; empty when it has none (a Conductor from before groups)."""
        async with self.session.get(f"{self.cfg.url}/v1/instances",
                                    headers=self.headers) as r:
            if r.status == 404:
                return set()
            if r.status != 200:
                raise CalibrationError(f"GET /v1/instances: HTTP {r.status}: {await r.text()}")
            listing = await r.json()
        return {int((i.get("group") or {}).get("size", 1)) for i in listing.get("prefill", [])
                if i.get("state") == "ready"}

    async def complete(self, prompt: list[int], max_tokens: int,
                       group: int = 0) -> tuple[float, int]:
        """One non-streaming completion: (latency ms, cached prompt tokens); `group` pins its
        prefill to a target of that many stages (0: any)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        headers = dict(self.headers)
        if group:
            headers[GROUP_HEADER] = str(group)
        t0 = time.perf_counter()
        async with self.session.post(f"{self.cfg.url}/v1/completions", json=body,
                                     headers=headers) as r:
            text = await r.text()
            ms = (time.perf_counter() - t0) * 1000
            if r.status != 200:
                raise CalibrationError(f"completion failed: HTTP {r.status}: {text[:300]}")
        usage = json.loads(text).get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return ms, cached

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[str, list[float]]:
        """One streaming completion: (decode instance, arrival time of every token)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        times: list[float] = []
        async with self.session.post(f"{self.cfg.url}/v1/completions", json=body,
                                     headers=self.headers) as r:
            if r.status != 200:
                raise CalibrationError(f"stream failed: HTTP {r.status}: {await r.text()}")
            where = r.headers.get("X-Mooncake-Decode", "")
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter() * 1000)
        return where, times


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(100, 10_000, size=n)]


async def _prefill_samples(c: _Client, cfg: CalibrateConfig, rng: np.random.Generator,
                           log: Callable[[str], None],
                           group: int = 0) -> list[tuple[int, int, float]]:
    """(new, cached, ms) of cold prompts and their extensions; `group` pins the target."""
    out: list[tuple[int, int, float]] = []
    what = f"group of {group}" if group > 1 else "prefill"
    for rep in range(cfg.repeats):
        for n in cfg.lengths:
            base = _prompt(rng, n)
            ms, cached = await c.complete(base, 1, group)
            out.append((n - cached, cached, ms))
            ext = base + _prompt(rng, cfg.suffix_tokens)
            ms2, cached2 = await c.complete(ext, 1, group)
            out.append((len(ext) - cached2, cached2, ms2))
            log(f"{what} {n:>6} tokens: cold {ms:8.1f} ms; +{cfg.suffix_tokens} with "
                f"{cached2} cached {ms2:8.1f} ms (round {rep + 1})")
    return out


async def _all_prefill_samples(c: _Client, cfg: CalibrateConfig, rng: np.random.Generator,
                               log: Callable[[str], None]
                               ) -> tuple[Samples | None, dict[int, Samples]]:
    """(single-instance samples, group size -> that size's samples). Without groups among
    the targets nothing is pinned (as before groups); with them each kind is pinned; None:
    no single instance is served."""
    sizes = await c.target_sizes() if cfg.groups else set()
    groups = sorted(g for g in sizes if g > 1)
    if not groups:
        return await _prefill_samples(c, cfg, rng, log), {}
    log(f"prefill targets: {', '.join(f'groups of {g}' for g in groups)}"
        + (" and single instances" if 1 in sizes else " (no single instance)"))
    out: dict[int, Samples] = {}
    for g in groups:
        await c.complete(_prompt(rng, 16), 1, g)  # warm-up: the group's lazy init
        out[g] = await _prefill_samples(c, cfg, rng, log, g)
    return (await _prefill_samples(c, cfg, rng, log, 1) if 1 in sizes else None), out


async def _decode_samples(c: _Client, cfg: CalibrateConfig, rng: np.random.Generator,
                          log: Callable[[str], None]) -> list[tuple[int, int, float]]:
    out: list[tuple[int, int, float]] = []
    for ctx in cfg.decode_context:
        for b in cfg.batches:
            res = await asyncio.gather(*(c.stream(_prompt(rng, ctx), cfg.decode_tokens)
                                         for _ in range(b)))
            by_inst: dict[str, list[list[float]]] = {}
            for where, times in res:
                by_inst.setdefault(where, []).append(times)
            for group in by_inst.values():
                start = max(t[0] for t in group if t)
                end = min(t[-1] for t in group if t)
                iv = [y - x for t in group for x, y in itertools.pairwise(t)
                      if x >= start and y <= end]
                if len(iv) < 3:
                    continue
                step = statistics.median(iv)
                batch = len(group)
                context = batch * (ctx + cfg.decode_tokens // 2)
                out.append((batch, context, step))
                log(f"decode batch {batch:>3} context {context:>7}: step {step:7.2f} ms")
    return out


def _watch_block_size(master: str, token: str, stop: threading.Event,
                      sizes: list[int]) -> threading.Thread:
    from mooncake_k8s.store.client import StoreClient

    def run() -> None:
        with StoreClient(master, token, timeout_s=5.0) as store:
            try:
                for ev in store.watch():
                    if ev.kind == 1:  # STORED
                        sizes.append(int(ev.size))
                    if stop.is_set() or len(sizes) >= 64:
                        return
            except Exception:
                return

    th = threading.Thread(target=run, name="calibrate-watch", daemon=True)
    th.start()
    return th


async def calibrate(cfg: CalibrateConfig, log: Callable[[str], None] = print) -> CostModel:
    if cfg.kv_bytes_per_token is None and not cfg.master:
        raise CalibrationError("pass --kv-bytes-per-token, or --master so the KV block size "
                               "can be read from the store")
    rng = np.random.default_rng(cfg.seed)
    sizes: list[int] = []
    stop = threading.Event()
    if cfg.kv_bytes_per_token is None and cfg.master:
        _watch_block_size(cfg.master, cfg.token, stop, sizes)
        await asyncio.sleep(0.2)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            c = _Client(cfg, session)
            try:
                await c.discover()
            except aiohttp.ClientError as e:
                raise CalibrationError(f"cannot reach {cfg.url}: {e}") from e
            log(f"calibrating {c.model} at {cfg.url}")
            await c.complete(_prompt(rng, 16), 1)  # warm-up: lazy init must not be fitted
            single, grouped = await _all_prefill_samples(c, cfg, rng, log)
            dec = await _decode_samples(c, cfg, rng, log)
    except (TimeoutError, aiohttp.ClientError) as e:
        raise CalibrationError(f"request to {cfg.url} failed or timed out after "
                               f"{cfg.timeout_s:.0f} s: {type(e).__name__}: {e}") from e
    finally:
        stop.set()
    kv = cfg.kv_bytes_per_token
    if kv is None:
        if not sizes:
            raise CalibrationError("saw no block stored in the store; is --master the "
                                   "deployment's master and prefix caching on?")
        kv = round((statistics.median(sizes) - HEADER_BYTES) / cfg.block_tokens)
    # With no single instance, the smallest group's fit stands in for `prefill`.
    pre = single if single is not None else grouped[min(grouped)]
    model = with_groups(_model(cfg, c.model, kv, pre, dec), grouped, single is not None,
                        cfg.group_chunk_tokens, cfg.group_chunks)
    if cfg.links and cfg.master:
        try:
            model = await asyncio.to_thread(measure_links, model, cfg, log)
        except CalibrationError as e:  # the endpoint's fit is still worth writing
            log(f"links not measured ({e}); transfer.pool is the fitted load cost")
    return model


def _model(cfg: CalibrateConfig, served: str, kv: int, pre: list[tuple[int, int, float]],
           dec: list[tuple[int, int, float]]) -> CostModel:
    """The fitted cost model of the endpoint's samples."""
    if len(dec) < 3:
        raise CalibrationError(f"only {len(dec)} usable decode samples; raise "
                               "--decode-tokens or the batch sizes")
    try:
        prefill, load_per_tok, pf = fit_prefill(pre)
        decode, df = fit_decode(dec)
    except CostModelError as e:
        raise CalibrationError(str(e)) from e
    if load_per_tok > 0:
        pool = Link(0.0, kv / (load_per_tok * 1e6))
        note = "pool bandwidth = kv_bytes_per_token / fitted load ms per cached token"
    else:
        # Loading was below what the latencies resolve: record the cost as one byte-time of
        # the fastest link we could have seen, and say so.
        pool = Link(0.0, 1e6)
        note = "load cost below measurement resolution; pool bandwidth set effectively free"
    return CostModel(
        name=cfg.name, kv_bytes_per_token=int(kv), prefill=prefill,
        transfer={"pool": pool},
        decode=Decode(decode.base_ms, decode.per_seq_ms, decode.per_ctx_token_ms, 0),
        source=f"mooncake calibrate against {cfg.url} ({served}) at "
               f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        extra={"prefill_fit": {"r2": round(pf.r2, 4), "samples": pf.samples},
               "decode_fit": {"r2": round(df.r2, 4), "samples": df.samples},
               "transfer_note": note,
               "samples": {"prefill_new_cached_ms": [list(s) for s in pre],
                           "decode_batch_context_ms": [list(s) for s in dec]}},
    )


def with_groups(model: CostModel, grouped: dict[int, Samples], single: bool = True,
                chunk_tokens: int = PIPELINE_CHUNK_TOKENS,
                chunks: int = PIPELINE_CHUNKS) -> CostModel:
    """`model` with each group size's prefill fit (`prefill_groups`) and its provenance;
    `single` False: no single instance was measured (`prefill` is the smallest group's fit,
    and `extra` says so)."""
    if not grouped:
        return model
    fits: dict[int, Prefill] = {}
    extra: dict[str, Any] = dict(model.extra)
    quality: dict[str, Any] = {}
    for g, samples in sorted(grouped.items()):
        try:
            fits[g], f = fit_group_prefill(samples, chunk_tokens, chunks)
        except CostModelError as e:
            raise CalibrationError(f"group of {g}: {e}") from e
        quality[str(g)] = {"r2": round(f.r2, 4), "samples": f.samples}
    extra["prefill_group_fits"] = quality
    extra["samples"] = {**extra.get("samples", {}), "prefill_group_new_cached_ms": {
        str(g): [list(s) for s in samples] for g, samples in sorted(grouped.items())}}
    if not single:
        extra["prefill_note"] = (f"no single prefill instance was served: `prefill` is the "
                                 f"group of {min(grouped)}'s fit")
    return replace(model, prefill_groups=fits, extra=extra)


def measure_links(base: CostModel, cfg: CalibrateConfig,
                  log: Callable[[str], None] = print) -> CostModel:
    """`base` with the links between hosts measured through the store at `cfg.master`."""
    assert cfg.master
    try:
        found = links_mod.measure(links_mod.LinkConfig(
            cfg.master, cfg.token, sizes=cfg.link_sizes, repeats=cfg.link_repeats), log)
    except links_mod.LinkError as e:
        raise CalibrationError(f"measuring the links: {e}") from e
    for what, link in (("pool (other hosts)", found.pool), ("local (this host)", found.local)):
        if link is not None:
            log(f"link {what}: {link.gbps:.3f} GB/s, latency {link.latency_ms:.3f} ms")
    if found.pool is None:
        log("no segment on another host: transfer.pool not measured")
    return links_mod.merge(base, found, f"store at {cfg.master}, "
                                        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


def run(cfg: CalibrateConfig, out: str, log: Callable[[str], None] = print,
        base: CostModel | None = None) -> dict[str, Any]:
    """Calibrate and write `out`; with `base` (`--links-only`) only the links are measured,
    into that profile (no model need be served)."""
    if base is not None:
        model = measure_links(replace(base, name=cfg.name), cfg, log)
    else:
        model = asyncio.run(calibrate(cfg, log))
    model.save(out)
    return model.to_dict()
