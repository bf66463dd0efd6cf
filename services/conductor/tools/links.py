"""`mooncake calibrate`'s network half: the KV links between hosts, measured through the store.

The scheduler's fetch-or-recompute choice is only as good as its idea of what moving KV costs,
and that is the network's: a prefix held on another host crosses it, one on the instance's own
host is a shared-memory copy. So this puts objects of several sizes into each DRAM segment of
the pool, one replica on that segment (`placement="preferred"`, sizes at most half its free
space), and reads each back with a client that has no location cache (every read asks the
master, as a first read of a block does), the same path a worker's KV load takes. Segments on
another host than the measuring process's (the store's `host_id`) give `transfer.pool`, those
on its own host `transfer.local`; each is fitted as ``latency_ms + bytes / gbps`` with
non-negative coefficients (`costmodel.nnls_fit`), and the samples, per-segment fits and fit
quality are kept in the profile's `extra`.

It needs only the store (master and nodes), no model served: the test bed calibrates a cluster
per link rate with `mooncake calibrate --links-only`, which writes these links into a base
profile (`merge`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mooncake_k8s.conductor.sched.costmodel import (
    CostModel,
    CostModelError,
    Link,
    nnls_fit,
)

KIB, MIB = 1 << 10, 1 << 20
SIZES = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
FREE_GBPS = 1e6
"""The bandwidth recorded when a link's per-byte cost is below what the timings resolve."""


class LinkError(RuntimeError):
    """The links could not be measured (no store, no segment to measure, failed puts)."""


@dataclass(frozen=True)
class LinkConfig:
    master: str
    token: str = ""
    sizes: Sequence[int] = SIZES
    repeats: int = 3
    segments: Sequence[str] = ()
    """Only these segments (default: every DRAM segment of the pool)."""
    host_id: str | None = None
    """The measuring host's id (default: this process's, as the store client computes it)."""
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Sample:
    segment: str
    host_id: str
    same_host: bool
    nbytes: int
    get_ms: float
    put_ms: float


@dataclass(frozen=True)
class Links:
    """What was measured: the fitted links (None where no segment of that kind existed)."""

    pool: Link | None
    local: Link | None
    samples: list[Sample]
    extra: dict[str, Any]


def measure(cfg: LinkConfig, log: Callable[[str], None] = print) -> Links:
    """Measure every chosen segment; raises LinkError when nothing could be measured."""
    from mooncake_k8s.common.errors import MooncakeError
    from mooncake_k8s.store.client import StoreClient

    if not cfg.sizes or cfg.repeats < 1:
        raise LinkError("need at least one size and one repeat")
    try:
        # The segment list with a short timeout: an unreachable master fails in seconds, not
        # after the measuring client's (long enough for 64 MiB over 100 Mbit/s).
        with StoreClient(cfg.master, cfg.token, timeout_s=min(5.0, cfg.timeout_s)) as probe:
            segs = _targets(probe.segments(), cfg.segments)
        with StoreClient(cfg.master, cfg.token, host_id=cfg.host_id, location_cache=False,
                         replicas=1, timeout_s=cfg.timeout_s) as client:
            samples = _sample_all(client, segs, cfg, log)
    except MooncakeError as e:
        raise LinkError(f"store at {cfg.master}: {type(e).__name__}: {e}") from e
    if not samples:
        raise LinkError("no segment had room for even the smallest object; free some space "
                        "or pass smaller --link-sizes")
    return fit(samples)


def _targets(segments: Sequence[Any], only: Sequence[str]) -> list[Any]:
    dram = [s for s in segments if s.tier == "dram"]
    if only:
        known = {s.name for s in dram}
        missing = [n for n in only if n not in known]
        if missing:
            raise LinkError(f"no DRAM segment named {', '.join(missing)}; the pool has "
                            f"{', '.join(sorted(known)) or 'none'}")
        dram = [s for s in dram if s.name in set(only)]
    if not dram:
        raise LinkError("the pool has no DRAM segment to measure (no storage node "
                        "registered?)")
    return dram


def _sample_all(client: Any, segs: Sequence[Any], cfg: LinkConfig,
                log: Callable[[str], None]) -> list[Sample]:
    from mooncake_k8s.common.netutil import local_host_id

    me = cfg.host_id or local_host_id()
    data = memoryview(np.random.default_rng(0).bytes(max(cfg.sizes)))
    run = uuid.uuid4().hex[:12]
    out: list[Sample] = []
    for seg in segs:
        same = seg.host_id == me
        room = (seg.size - seg.used) // 2
        sizes = [n for n in sorted(cfg.sizes) if n <= room]
        if len(sizes) < len(cfg.sizes):
            log(f"{seg.name}: {len(cfg.sizes) - len(sizes)} size(s) skipped, over half the "
                f"segment's {room * 2 >> 20} MiB free")
        if not sizes:
            continue
        # The first transfer to a peer connects (and maps shared memory): not a sample.
        _one(client, f"mooncake-calibrate/{run}/{seg.name}/warm", data[:sizes[0]], seg.name)
        for n in sizes:
            for r in range(cfg.repeats):
                put_ms, get_ms = _one(client, f"mooncake-calibrate/{run}/{seg.name}/{n}/{r}",
                                      data[:n], seg.name)
                out.append(Sample(seg.name, seg.host_id, same, n, get_ms, put_ms))
            ms = [s.get_ms for s in out[-cfg.repeats:]]
            log(f"{seg.name} ({'this host' if same else 'host ' + seg.host_id[-12:]}): "
                f"{n >> 10:>6} KiB read in {min(ms):8.2f} ms "
                f"({n / (min(ms) * 1e6):6.3f} GB/s best)")
    return out


def _one(client: Any, key: str, data: memoryview, segment: str) -> tuple[float, float]:
    """Put `data` on `segment`, read it back through a fresh lookup, remove it: (put ms, get
    ms)."""
    buf = bytearray(len(data))
    t0 = time.perf_counter()
    client.put(key, data, replicas=1, placement="preferred", preferred_segment=segment)
    t1 = time.perf_counter()
    try:
        n = client.get_into(key, buf)
        t2 = time.perf_counter()
    finally:
        client.remove(key, force=True)
    if n != len(data) or buf != data:
        raise LinkError(f"read back {n} bytes of {len(data)} from {segment}, or other bytes")
    return (t1 - t0) * 1000.0, (t2 - t1) * 1000.0


def _fit_link(samples: Sequence[Sample]) -> tuple[Link, dict[str, Any]]:
    """latency_ms + bytes / gbps through the read samples (both >= 0)."""
    try:
        f = nnls_fit([[1.0] * len(samples), [float(s.nbytes) for s in samples]],
                     [s.get_ms for s in samples])
    except CostModelError as e:
        raise LinkError(str(e)) from e
    latency, ms_per_byte = f.coef
    gbps = 1.0 / (ms_per_byte * 1e6) if ms_per_byte > 0 else FREE_GBPS
    return Link(latency, gbps), {"latency_ms": round(latency, 4), "gbps": round(gbps, 4),
                                 "r2": round(f.r2, 4), "samples": f.samples}


def fit(samples: Sequence[Sample]) -> Links:
    """The pool link (segments on other hosts) and the local one (this host's), fitted."""
    other = [s for s in samples if not s.same_host]
    mine = [s for s in samples if s.same_host]
    pool, pool_fit = _fit_link(other) if len({s.nbytes for s in other}) > 1 else (None, None)
    local, local_fit = _fit_link(mine) if len({s.nbytes for s in mine}) > 1 else (None, None)
    per_segment = {}
    for name in dict.fromkeys(s.segment for s in samples):
        mine_seg = [s for s in samples if s.segment == name]
        if len({s.nbytes for s in mine_seg}) > 1:
            per_segment[name] = {"host_id": mine_seg[0].host_id,
                                 "same_host": mine_seg[0].same_host,
                                 **_fit_link(mine_seg)[1]}
    extra = {"pool_fit": pool_fit, "local_fit": local_fit, "segments": per_segment,
             "samples_segment_bytes_get_put_ms": [
                 [s.segment, s.nbytes, round(s.get_ms, 3), round(s.put_ms, 3)]
                 for s in samples]}
    return Links(pool, local, list(samples), extra)


def merge(base: CostModel, links: Links, source: str) -> CostModel:
    """`base` with the measured links in `transfer` and the measurement in `extra["links"]`.

    A link not measured stays as it was, except that a base without a `local` link keeps its
    old `pool` one as `local` when the pool is replaced: a base profile measured on one host
    (as the shipped CPU profile was) measured a same-host load, and without it the fallback
    (`CostModel.link`) would cost a local prefix as a remote one."""
    transfer = dict(base.transfer)
    notes = []
    if links.pool is not None:
        if "local" not in transfer and links.local is None:
            transfer["local"] = transfer["pool"]
            notes.append("local: the base profile's pool link (not measured here)")
        transfer["pool"] = links.pool
    if links.local is not None:
        transfer["local"] = links.local
    return replace(base, transfer=transfer, extra={**base.extra, "links": {
        "source": source, "notes": notes, **links.extra}})
