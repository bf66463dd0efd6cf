"""How long things take: prefill, KV transfer, decode steps. The scheduler's only clock.

Every estimate the scheduler makes (TTFT of a candidate, TBT of a decode batch, when the queue
drains) is a call into `CostModel`, and every coefficient in it comes from data: a profile
written by `mooncake calibrate` from measurements of a running deployment, or one of the
documented profiles shipped in `profiles/` (each says where its numbers come from). Code holds
the *shape* of the model only:

- prefill: ``base + per_token * new + attn * new * (cached + new / 2)``. The last term is the
  attention work of the new tokens over the whole prefix (the paper's ``a n^2 d`` split into
  what a cached prefix saves), so a long cached prefix still costs something to attend over.
- transfer: ``latency + bytes / bandwidth`` per path (``local`` DRAM, ``pool`` over the
  network, ``ssd``, ``decode`` for the prefill-to-decode handoff).
- decode step: ``base + per_seq * batch + per_ctx_token * context_tokens`` (weights are read
  once per step; every sequence adds compute; every cached token is read once per step).

Prefill groups (chunked pipeline-parallel prefill, issue 21): a group of G stages is one
prefill target with its own prefill fit, `prefill_groups[G]` (`GroupPrefill`, measured by
`mooncake calibrate` through the group's leader): the single shape plus a *fill* term over the
first m = min(new, fill_tokens, ceil(new / fill_chunks)) tokens (the first pipeline chunk: the
workers cut a prompt into about `fill_chunks` chunks of at most `fill_tokens`),
``fill * m + fill_attn * m * (cached + m / 2)``. A
chunk of c tokens goes through every stage in turn, so the last chunk reaches the last stage
(G-1)/G of a chunk's compute after the first stage is done: with k chunks the pipeline takes
about ``P(n)/G + (G-1)/G * P(min(n, c))``. A profile without an entry for G uses that estimate
from the single-instance fit (`pipelined`): per-token and attention terms / G, the fill terms
(G-1)/G of them up to one chunk (`PIPELINE_CHUNK_TOKENS`), the per-request base kept whole
plus `PIPELINE_HOP_MS` per stage boundary (a notification and a hidden-state write; at 10
Gbit/s a 256-token chunk of SmolLM2's hidden states, under 1 MiB, moves in under a
millisecond, and later chunks' hops overlap compute). So a prompt of at most one chunk costs a
little more on a group than on one instance (no parallelism, and a group holds G hosts for it)
and a long one tends to 1/G of it.

The fits are ordinary least squares with coefficients clamped at zero (a negative time per
token is noise, never physics).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

PATHS = ("local", "pool", "ssd", "decode")
DEFAULT_PROFILE = "llama3-70b-a800x8"
BUILTIN_CPU_PROFILE = "smollm2-135m-cpu"
"""Measured with `mooncake calibrate` on `mooncake up` serving the built-in SmolLM2-135M on a
CPU; the Conductor's default when it serves that model on a CPU (`default_profile`)."""
PIPELINE_CHUNK_TOKENS = 1024
"""The workers' default largest pipeline chunk (`WorkerConfig.pipeline_chunk_tokens`)."""
PIPELINE_MIN_CHUNK = 64
"""The smallest pipeline chunk: the engine's compute chunk (its default, the block size)."""
PIPELINE_CHUNKS = 8
"""The workers' default chunks per prompt (`WorkerConfig.pipeline_chunks`): with the largest
chunk, what the group estimate (`pipelined`, `fit_group_prefill`) takes for the fill."""
PIPELINE_HOP_MS = 1.0
"""The uncalibrated estimate's cost of one stage boundary that compute does not hide (the
first chunk's handoff): an assumption, replaced by a measured group entry's base."""


class CostModelError(ValueError):
    """A profile file that is missing, malformed or physically impossible."""


@dataclass(frozen=True)
class Prefill:
    base_ms: float
    per_token_ms: float
    attn_ms: float
    """ms per (new token x attended token): the quadratic attention term."""

    def ms(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        return self.base_ms + self.per_token_ms * new + self.attn_ms * new * (cached + new / 2)

    def queue_ms(self, jobs: int, tokens: int) -> float:
        """Until `jobs` queued requests of `tokens` prompt tokens in all are done (their
        cached share unknown: an upper bound)."""
        return self.base_ms * jobs + self.per_token_ms * tokens


@dataclass(frozen=True)
class GroupPrefill(Prefill):
    """A pipelined prefill group's fit: `Prefill`'s terms plus the pipeline's fill over the
    first m = `first_chunk(new)` tokens (the module's docstring):
    ``fill_ms_per_token * m + fill_attn_ms * m * (cached + m / 2)``."""

    fill_ms_per_token: float = 0.0
    fill_attn_ms: float = 0.0
    fill_tokens: int = 0
    """The largest pipeline chunk the fill is counted up to (the workers'
    pipeline_chunk_tokens)."""
    fill_chunks: int = 0
    """Chunks the workers cut a prompt into (pipeline_chunks; 0 = every chunk fill_tokens)."""

    def first_chunk(self, new: int) -> int:
        """Tokens of a prompt's first pipeline chunk, as the workers cut it."""
        m = min(new, self.fill_tokens)
        if self.fill_chunks <= 0:
            return m
        return min(m, max(PIPELINE_MIN_CHUNK, -(-new // self.fill_chunks)))

    def ms(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        m = self.first_chunk(new)
        return (super().ms(new, cached) + self.fill_ms_per_token * m
                + self.fill_attn_ms * m * (cached + m / 2))

    def queue_ms(self, jobs: int, tokens: int) -> float:
        """Until `jobs` requests of `tokens` in all are done: each fills the pipeline once
        (at most a chunk's worth; its attention term left out, as the cached share is)."""
        fill = self.fill_ms_per_token * min(tokens, self.fill_tokens * jobs)
        return super().queue_ms(jobs, tokens) + fill


@dataclass(frozen=True)
class Link:
    latency_ms: float
    gbps: float
    """GB/s (1e9 bytes per second)."""

    def ms(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_ms + nbytes / (self.gbps * 1e6)


@dataclass(frozen=True)
class Decode:
    base_ms: float
    per_seq_ms: float
    per_ctx_token_ms: float
    kv_capacity_tokens: int = 0
    """KV tokens one decode instance holds (0 = unknown; live reports override it)."""

    def step_ms(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base_ms + self.per_seq_ms * batch + self.per_ctx_token_ms * context_tokens


@dataclass(frozen=True)
class CostModel:
    name: str
    kv_bytes_per_token: int
    prefill: Prefill
    transfer: Mapping[str, Link]
    decode: Decode
    source: str = ""
    """Where the numbers come from (calibration run, paper table, ...)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form provenance: assumptions, fit quality, sample counts."""
    prefill_groups: Mapping[int, Prefill] = field(default_factory=dict)
    """Group size (>= 2) -> the prefill fit of a pipelined group of that many stages, as
    measured through its leader; a size not listed is estimated (`pipelined`)."""
    _estimates: dict[int, Prefill] = field(default_factory=dict, init=False, repr=False,
                                           compare=False)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise CostModelError("kv_bytes_per_token must be > 0")
        for g, pf in self.prefill_groups.items():
            if not isinstance(g, int) or isinstance(g, bool) or g < 2:
                raise CostModelError(f"prefill_groups: group size must be an integer >= 2, "
                                     f"got {g!r}")
            _check(f"prefill_groups.{g}", pf)
        for k, link in self.transfer.items():
            if k not in PATHS:
                raise CostModelError(f"unknown transfer path {k!r}; known: {list(PATHS)}")
            if not link.gbps > 0 or link.latency_ms < 0:
                raise CostModelError(f"transfer.{k}: gbps must be > 0 and latency_ms >= 0")
        for part, obj in (("prefill", self.prefill), ("decode", self.decode)):
            _check(part, obj)
        if "pool" not in self.transfer:
            raise CostModelError("transfer.pool is required (the path to the shared KV pool)")

    # -- estimates -------------------------------------------------------------------------

    def link(self, path: str) -> Link:
        """The named path, falling back to the pool (a profile may not measure every path)."""
        return self.transfer.get(path) or self.transfer["pool"]

    def transfer_ms(self, path: str, tokens: int) -> float:
        return self.link(path).ms(tokens * self.kv_bytes_per_token)

    def remote_ms(self, tokens: int) -> float:
        """Loading `tokens` of KV held on another host: the pool link, and never less than
        loading them from this host plus the network's latency. The bytes that cross the
        network are then loaded as a local hit's are, so a network measured faster than the
        engine loads (10 Gbit/s against the CPU profile's end-to-end local load) must not
        make a prefix on another host look as cheap as the same prefix here."""
        wire = self.transfer_ms("pool", tokens)
        here = self.transfer_ms("local", tokens)
        return wire if wire > here or tokens <= 0 else here + self.link("pool").latency_ms

    def prefill_ms(self, new: int, cached: int = 0, group: int = 1) -> float:
        """Prefill time on a single instance (`group` 1) or a group of `group` stages."""
        if group <= 1:
            return self.prefill.ms(new, cached)
        return self.prefill_for(group).ms(new, cached)

    def prefill_for(self, group: int) -> Prefill:
        """The prefill fit of a target of `group` stages: `prefill` for a single instance,
        the measured `prefill_groups` entry, else the estimate (`pipelined`), made once."""
        if group <= 1:
            return self.prefill
        pf = self.prefill_groups.get(group) or self._estimates.get(group)
        if pf is None:
            pf = self._estimates[group] = pipelined(self.prefill, group)
        return pf

    def measured_group(self, group: int) -> bool:
        """Whether `prefill_for(group)` is measured (not the estimate)."""
        return group <= 1 or group in self.prefill_groups

    def step_ms(self, batch: int, context_tokens: int) -> float:
        return self.decode.step_ms(batch, context_tokens)

    # -- files -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "source": self.source,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill": asdict(self.prefill),
        }
        if self.prefill_groups:
            d["prefill_groups"] = {str(g): asdict(pf)
                                   for g, pf in sorted(self.prefill_groups.items())}
        return {**d, "transfer": {k: asdict(v) for k, v in self.transfer.items()},
                "decode": asdict(self.decode), "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        try:
            return cls(
                name=str(d.get("name", "unnamed")), source=str(d.get("source", "")),
                kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                prefill=Prefill(**{k: float(v) for k, v in d["prefill"].items()}),
                transfer={k: Link(float(v["latency_ms"]), float(v["gbps"]))
                          for k, v in d["transfer"].items()},
                decode=_decode_of(d["decode"]),
                extra=dict(d.get("extra", {})),
                prefill_groups=_groups_of(d.get("prefill_groups") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CostModelError):
                raise
            raise CostModelError(f"malformed cost model: {type(e).__name__}: {e}") from e

    def save(self, path: str | Path) -> None:
        p = Path(path)
        text: str
        if p.suffix in (".yaml", ".yml"):
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        else:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        p.write_text(text)


def _check(part: str, obj: Prefill | Decode) -> None:
    for k, v in asdict(obj).items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise CostModelError(f"{part}.{k} must be a finite number >= 0, got {v!r}")


def _groups_of(d: Mapping[str, Any]) -> dict[int, Prefill]:
    """`prefill_groups` as a file spells it (keys are strings in JSON)."""
    out: dict[int, Prefill] = {}
    for g, pf in d.items():
        try:
            size = int(g)
        except ValueError:
            raise CostModelError(f"prefill_groups: group size must be an integer >= 2, "
                                 f"got {g!r}") from None
        vals: dict[str, Any] = {k: float(v) for k, v in pf.items()}
        vals["fill_tokens"] = int(vals.get("fill_tokens", 0))
        vals["fill_chunks"] = int(vals.get("fill_chunks", 0))
        out[size] = GroupPrefill(**vals)
    return out


def pipelined(single: Prefill, group: int, chunk_tokens: int = PIPELINE_CHUNK_TOKENS,
              chunks: int = PIPELINE_CHUNKS) -> Prefill:
    """The uncalibrated estimate of a group of `group` stages from the single-instance fit
    (the module's docstring says why this shape): per-token and attention work / G, the base
    kept whole plus a hop per stage boundary, and the pipeline's fill: (G-1)/G of the
    per-token and attention costs up to one chunk."""
    g = max(1, group)
    if g == 1:
        return single
    share = (g - 1) / g
    return GroupPrefill(single.base_ms + (g - 1) * PIPELINE_HOP_MS, single.per_token_ms / g,
                        single.attn_ms / g, single.per_token_ms * share,
                        single.attn_ms * share, chunk_tokens, chunks)


def _decode_of(d: Mapping[str, Any]) -> Decode:
    return Decode(float(d["base_ms"]), float(d["per_seq_ms"]), float(d["per_ctx_token_ms"]),
                  int(d.get("kv_capacity_tokens", 0)))


def profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    root = resources.files("mooncake_k8s.conductor.sched") / "profiles"
    return sorted(e.name.rsplit(".", 1)[0] for e in root.iterdir() if e.name.endswith(".json"))


def default_profile(model: str | None, device: str | None) -> str:
    """The shipped profile for a deployment when no cost model is given: the built-in model
    (`model` None) on a CPU gets its measured CPU profile; anything else the paper's
    LLaMA3-70B profile. `device` None means CUDA when torch sees one (as the engine picks)."""
    if model is not None:
        return DEFAULT_PROFILE
    if device is None:
        device = "cuda" if cuda_visible() else "cpu"
    return BUILTIN_CPU_PROFILE if device == "cpu" else DEFAULT_PROFILE


def cuda_visible() -> bool:
    """Whether this host shows a CUDA device: an NVIDIA driver's device node, unless
    CUDA_VISIBLE_DEVICES hides them all. Asked without importing torch, which would be most of
    a Conductor's start (seconds of CPU) for one yes or no."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def load(spec: str | Path | None = None) -> CostModel:
    """A profile by shipped name or by path (.json, .yaml); None = the default profile."""
    spec = str(spec) if spec else DEFAULT_PROFILE
    path = Path(spec)
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as e:
            raise CostModelError(f"cannot read cost model {spec!r}: {e}") from e
    else:
        res = resources.files("mooncake_k8s.conductor.sched") / "profiles" / f"{spec}.json"
        if not res.is_file():
            raise CostModelError(f"no cost model {spec!r}: not a file, and not a shipped "
                                 f"profile ({', '.join(profiles())})")
        text = res.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        raise CostModelError(f"cost model {spec!r} is not valid JSON/YAML: {e}") from e
    if not isinstance(data, dict):
        raise CostModelError(f"cost model {spec!r} must be a mapping")
    return CostModel.from_dict(data)


# -- fitting (used by `mooncake calibrate`) ------------------------------------------------


@dataclass(frozen=True)
class Fit:
    coef: tuple[float, ...]
    r2: float
    samples: int


def nnls_fit(columns: Sequence[Sequence[float]], y: Sequence[float]) -> Fit:
    """Least squares with every coefficient >= 0: refit without the columns that went
    negative until none does (an active-set pass; enough for a handful of columns)."""
    x = np.asarray(columns, dtype=np.float64).T
    t = np.asarray(y, dtype=np.float64)
    if x.shape[0] < x.shape[1]:
        raise CostModelError(f"need at least {x.shape[1]} samples to fit, got {x.shape[0]}")
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], t, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [c for c, s in zip(active, sol, strict=True) if s >= 0]
    pred = x @ coef
    ss_res = float(((t - pred) ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return Fit(tuple(float(c) for c in coef), r2, int(x.shape[0]))


def fit_prefill(samples: Sequence[tuple[int, int, float]]) -> tuple[Prefill, float, Fit]:
    """(new, cached, ms) samples -> the prefill model and the per-cached-token load cost.

    Measured end to end, a request with a cached prefix pays for loading it; that cost is
    linear in the cached tokens, so it is fitted as its own column and returned apart (the
    caller turns it into the pool link's bandwidth)."""
    cols = [
        [1.0] * len(samples),
        [float(n) for n, _, _ in samples],
        [n * (c + n / 2) for n, c, _ in samples],
        [float(c) for _, c, _ in samples],
    ]
    f = nnls_fit(cols, [ms for _, _, ms in samples])
    base, per_tok, attn, load_per_tok = f.coef
    return Prefill(base, per_tok, attn), load_per_tok, f


def fit_group_prefill(samples: Sequence[tuple[int, int, float]],
                      chunk_tokens: int = PIPELINE_CHUNK_TOKENS,
                      chunks: int = PIPELINE_CHUNKS) -> tuple[GroupPrefill, Fit]:
    """(new, cached, ms) samples of a group (through its leader) -> its `GroupPrefill`: the
    prefill columns plus the fill's over m = min(new, chunk) (prompts shorter and longer than
    a chunk tell them from the others), and the load column as in `fit_prefill`."""
    shape = GroupPrefill(0.0, 0.0, 0.0, fill_tokens=chunk_tokens, fill_chunks=chunks)
    ms_ = [float(shape.first_chunk(n)) for n, _, _ in samples]
    cols = [
        [1.0] * len(samples),
        [float(n) for n, _, _ in samples],
        [n * (c + n / 2) for n, c, _ in samples],
        ms_,
        [m * (c + m / 2) for m, (_, c, _) in zip(ms_, samples, strict=True)],
        [float(c) for _, c, _ in samples],
    ]
    f = nnls_fit(cols, [ms for _, _, ms in samples])
    base, per_tok, attn, fill, fill_attn, _load = f.coef
    return GroupPrefill(base, per_tok, attn, fill, fill_attn, chunk_tokens, chunks), f


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> tuple[Decode, Fit]:
    """(batch, context tokens, step ms) samples -> the decode step model."""
    cols = [
        [1.0] * len(samples),
        [float(b) for b, _, _ in samples],
        [float(c) for _, c, _ in samples],
    ]
    f = nnls_fit(cols, [ms for _, _, ms in samples])
    base, per_seq, per_ctx = f.coef
    return Decode(base, per_seq, per_ctx), f
