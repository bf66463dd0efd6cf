"""`mooncake replay | analyze | calibrate`: the scheduler's offline tools.

`replay` runs the real scheduler against a simulated cluster on a request trace, `analyze`
says whether a trace's prefix reuse pays for KV caching, `calibrate` measures a running
deployment into the cost model both of them (and the live Conductor) use. `cli.main` registers
`COMMANDS`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from mooncake_k8s.cli.options import MASTERS, SIZE, _token_opt
from mooncake_k8s.common import defaults as d
from mooncake_k8s.common.defaults import BLOCK_TOKENS


def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(2)


def _load_trace(path: str, limit: int | None) -> Any:
    from mooncake_k8s.conductor.tools.sim import trace

    try:
        return trace.load(path, limit=limit)
    except trace.TraceError as e:
        _fail(str(e))


def _load_model(spec: str | None) -> Any:
    from mooncake_k8s.conductor.sched import costmodel

    try:
        return costmodel.load(spec)
    except costmodel.CostModelError as e:
        _fail(str(e))


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}",
                                 param_hint=what) from None
    if not vals or any(v <= 0 for v in vals):
        raise click.BadParameter("every value must be > 0", param_hint=what)
    return vals


def _write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    click.echo(f"wrote {path}")


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.jsonl", type=click.Path(dir_okay=False))
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False),
              help="Write {setup, rows} here.")
@click.option("--policies", default=None,
              help="Comma-separated subset of random, round_robin, load_balancing, "
                   "local_cache_aware, global_cache_aware [default: all].")
@click.option("--early-rejection", "er", default="both", show_default=True,
              type=click.Choice(["both", "on", "off"]),
              help="Replay each policy with early rejection, without, or both.")
@click.option("--prefill", "n_prefill", default=8, show_default=True,
              type=click.IntRange(1, 4096), help="Simulated prefill instances.")
@click.option("--decode", "n_decode", default=8, show_default=True,
              type=click.IntRange(1, 4096), help="Simulated decode instances.")
@click.option("--block-tokens", default=None, type=click.IntRange(1),
              help="Tokens per trace block [default: inferred; 512 for Mooncake's traces].")
@click.option("--cache-tokens", default="3000000", show_default=True, type=SIZE,
              help="Local DRAM KV cache per prefill instance, in tokens.")
@click.option("--ttft-slo-ms", default=30_000.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True))
@click.option("--tbt-slo-ms", default=100.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True))
@click.option("--rate-scale", default="1.0", show_default=True,
              help="Arrival rate multiplier(s), comma-separated: each is a separate replay.")
@click.option("--profile", default=None,
              help="Cost model: a shipped profile name or a calibrated file "
                   "[default: llama3-70b-a800x8].")
@click.option("--noise", default=0.0, show_default=True, type=click.FloatRange(0, 2),
              help="Sigma of lognormal noise on prefill times (prediction error).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--limit", default=None, type=click.IntRange(1),
              help="Replay only the first N requests.")
def replay(trace_path: str, json_out: str | None, policies: str | None, er: str,
           n_prefill: int, n_decode: int, block_tokens: int | None, cache_tokens: int,
           ttft_slo_ms: float, tbt_slo_ms: float, rate_scale: str, profile: str | None,
           noise: float, seed: int, limit: int | None) -> None:
    """Replay a Mooncake-format trace against a simulated cluster, policy by policy."""
    from mooncake_k8s.conductor.sched.scheduler import POLICIES
    from mooncake_k8s.conductor.tools.sim import replay as rp
    from mooncake_k8s.conductor.tools.sim.trace import TraceError, infer_block_tokens

    pols = [p.strip() for p in policies.split(",")] if policies else list(POLICIES)
    bad = [p for p in pols if p not in POLICIES]
    if bad:
        raise click.BadParameter(f"unknown policy {bad[0]!r}; known: {', '.join(POLICIES)}",
                                 param_hint="--policies")
    scales = _floats(rate_scale, "--rate-scale")
    reqs = _load_trace(trace_path, limit)
    model = _load_model(profile)
    if block_tokens is None:
        try:
            block_tokens = infer_block_tokens(reqs)
        except TraceError as e:
            _fail(str(e))
    ers = {"both": (False, True), "on": (True,), "off": (False,)}[er]
    rows: list[dict[str, Any]] = []
    setup = None
    for scale in scales:
        setup = rp.ReplaySetup(
            prefill_instances=n_prefill, decode_instances=n_decode,
            block_tokens=int(block_tokens or 512), local_cache_tokens=cache_tokens,
            ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, rate_scale=scale, noise=noise,
            seed=seed, profile=profile or model.name)
        def progress(msg: str, s: float = scale) -> None:
            click.echo(f"  [x{s}] {msg}", err=True)

        out = rp.run_all(reqs, setup, model, pols, ers, progress=progress)
        rows += [{**r, "rate_scale": scale} for r in out["rows"]]
    assert setup is not None
    summary = out["setup"]
    summary["rate_scale"] = scales[0] if len(scales) == 1 else scales
    summary["trace"] = str(trace_path)
    checks = rp.checks(rows)
    click.echo(rp.table(rows, with_scale=len(scales) > 1))
    for c in checks:
        click.echo(c["text"])
    if json_out:
        _write_json(json_out, {"setup": summary, "rows": rows, "checks": checks})


@click.command("analyze")
@click.argument("trace_path", metavar="TRACE.jsonl", type=click.Path(dir_okay=False))
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False),
              help="Write the curve, tiers, reuse and break-even figures here.")
@click.option("--plot", "plot_out", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG: hit rate vs capacity and saving vs bandwidth.")
@click.option("--block-tokens", default=None, type=click.IntRange(1),
              help="Tokens per trace block [default: inferred].")
@click.option("--dram-tokens", default="3000000", show_default=True, type=SIZE,
              help="DRAM tier capacity in tokens (the paper's ~1 TB node holds ~3M of "
                   "LLaMA3-70B's).")
@click.option("--ssd-tokens", default="30000000", show_default=True, type=SIZE,
              help="SSD tier capacity in tokens, behind DRAM (0 = no SSD tier).")
@click.option("--profile", default=None,
              help="Model shape and link speeds from a cost model [default: "
                   "llama3-70b-a800x8].")
@click.option("--kv-bytes-per-token", default=None, type=click.IntRange(1),
              help="Override the profile's KV bytes per token.")
@click.option("--prefill-ms-per-token", default=None,
              type=click.FloatRange(min=0, min_open=True),
              help="A linear prefill cost instead of the profile's model.")
@click.option("--bandwidth-gbps", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Link cached KV is loaded over [default: the profile's pool link].")
@click.option("--ssd-gbps", default=None, type=click.FloatRange(min=0, min_open=True),
              help="SSD read bandwidth [default: the profile's ssd link].")
@click.option("--limit", default=None, type=click.IntRange(1))
def analyze(trace_path: str, json_out: str | None, plot_out: str | None,
            block_tokens: int | None, dram_tokens: int, ssd_tokens: int, profile: str | None,
            kv_bytes_per_token: int | None, prefill_ms_per_token: float | None,
            bandwidth_gbps: float | None, ssd_gbps: float | None, limit: int | None) -> None:
    """Measure a trace's prefix reuse: hit rate vs capacity, TTFT saving, break-even."""
    from dataclasses import replace

    from mooncake_k8s.conductor.tools import analyze as an
    from mooncake_k8s.conductor.tools.sim.trace import TraceError, infer_block_tokens

    reqs = _load_trace(trace_path, limit)
    model = _load_model(profile)
    if kv_bytes_per_token:
        model = replace(model, kv_bytes_per_token=kv_bytes_per_token)
    if block_tokens is None:
        try:
            block_tokens = infer_block_tokens(reqs)
        except TraceError as e:
            _fail(str(e))
    opts = an.Options(int(block_tokens or 512), dram_tokens, ssd_tokens, model,
                      bandwidth_gbps or model.link("pool").gbps,
                      ssd_gbps or model.link("ssd").gbps, prefill_ms_per_token)
    result = an.analyze(reqs, opts)
    result["trace"]["path"] = str(trace_path)
    click.echo(an.report(result))
    if plot_out:
        try:
            an.plot(result, plot_out)
        except RuntimeError as e:
            _fail(str(e))
        click.echo(f"wrote {plot_out}")
    if json_out:
        _write_json(json_out, result)


def _sizes(text: str, what: str) -> tuple[int, ...]:
    from mooncake_k8s.cli.options import parse_size

    try:
        vals = tuple(parse_size(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=what) from None
    if len(set(vals)) < 2 or min(vals) < 1:
        raise click.BadParameter("need at least two different sizes >= 1 byte (the fit is "
                                 "latency + bytes / rate)", param_hint=what)
    return vals


@click.command("calibrate")
@click.option("--url", envvar="MOONCAKE_URL", default=f"http://127.0.0.1:{d.CONDUCTOR_PORT}",
              show_default=True, show_envvar=True, help="The deployment's OpenAI endpoint.")
@click.option("--api-key", envvar="MOONCAKE_API_KEY", default=None, show_envvar=True)
@click.option("--model", default=None, help="Model name [default: the one served].")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Where to write the cost model (.json, or .yaml).")
@click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=None, show_envvar=True,
              help="Store master: read the KV block size from its events.")
@_token_opt
@click.option("--kv-bytes-per-token", default=None, type=click.IntRange(1),
              help="KV bytes per token, when not read from the store.")
@click.option("--block-tokens", default=BLOCK_TOKENS, show_default=True, type=click.IntRange(1),
              help="The cluster's tokens per KV block (to read the block size).")
@click.option("--lengths", default="64,128,256,512,1024", show_default=True,
              help="Prompt lengths for the prefill fit.")
@click.option("--batches", default="1,2,4,8", show_default=True,
              help="Concurrent streams for the decode fit.")
@click.option("--decode-tokens", default=32, show_default=True, type=click.IntRange(4))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 20))
@click.option("--name", default="calibrated", show_default=True)
@click.option("--links/--no-links", default=True, show_default=True,
              help="With --master: measure the KV links to the pool's segments on other hosts "
                   "(transfer.pool) and on this host (transfer.local).")
@click.option("--links-only", is_flag=True,
              help="Measure only the links (needs --master, no model served) into --profile.")
@click.option("--profile", default=None,
              help="With --links-only: the profile the links are written into, a shipped "
                   "name or a file [default: the Conductor's default for this machine].")
@click.option("--link-sizes", default="256KiB,1MiB,4MiB,16MiB,64MiB", show_default=True,
              help="Object sizes put and read back on each segment.")
@click.option("--link-repeats", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--groups/--no-groups", default=True, show_default=True,
              help="Measure the prefill groups among the Conductor's prefill targets, each "
                   "group size into the profile's prefill_groups (single instances pinned "
                   "apart for the prefill fit).")
@click.option("--group-chunk-tokens", default=256, show_default=True, type=click.IntRange(1),
              help="The groups' pipeline chunk (their --pipeline-chunk-tokens): where a group "
                   "fit's pipeline-fill term stops growing.")
def calibrate(url: str, api_key: str | None, model: str | None, out: str, master: str | None,
              token: str, kv_bytes_per_token: int | None, block_tokens: int, lengths: str,
              batches: str, decode_tokens: int, repeats: int, name: str, links: bool,
              links_only: bool, profile: str | None, link_sizes: str,
              link_repeats: int, groups: bool, group_chunk_tokens: int) -> None:
    """Measure a running deployment (or, --links-only, the store's links between hosts) and
    write the cost model the Conductor loads."""
    from mooncake_k8s.conductor.tools import calibrate as cal

    if links_only and not master:
        raise click.BadParameter("--links-only measures through the store: give --master",
                                 param_hint="--master")
    if profile and not links_only:
        raise click.BadParameter("only with --links-only (a full calibration measures the "
                                 "whole profile)", param_hint="--profile")
    cfg = cal.CalibrateConfig(
        url=url.rstrip("/"), api_key=api_key, model=model,
        lengths=tuple(int(x) for x in _floats(lengths, "--lengths")),
        batches=tuple(int(x) for x in _floats(batches, "--batches")),
        decode_tokens=decode_tokens, repeats=repeats, kv_bytes_per_token=kv_bytes_per_token,
        master=master, token=token, block_tokens=block_tokens, name=name, links=links,
        link_sizes=_sizes(link_sizes, "--link-sizes"), link_repeats=link_repeats,
        groups=groups, group_chunk_tokens=group_chunk_tokens)
    base = None
    if links_only:
        from mooncake_k8s.conductor.sched.costmodel import default_profile

        base = _load_model(profile or default_profile(None, None))
    try:
        data = cal.run(cfg, out, click.echo, base=base)
    except cal.CalibrationError as e:
        _fail(str(e))
    click.echo(json.dumps({k: data[k] for k in ("prefill", "prefill_groups", "transfer",
                                                "decode") if k in data}, indent=2))
    click.echo(f"wrote {out}")


COMMANDS = [replay, analyze, calibrate]
