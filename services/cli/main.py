"""The `mooncake` command line: one entry point, a subcommand group per component.

Every flag can also come from an environment variable (shown in `--help`), which is how the
operator configures pods. Heavy imports happen inside commands so `--help` stays fast.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import click

from mooncake_k8s.cli.options import (  # noqa: F401 (re-exported for tests and plugins)
    MASTERS,
    SIZE,
    SizeType,
    _check_bind,
    _token_opt,
    _warn_no_token,
    _with_logs,
    parse_size,
)
from mooncake_k8s.cli.p2p import p2p as _p2p_command
from mooncake_k8s.cli.sidecar import sidecar as _sidecar_command
from mooncake_k8s.cli.startup import guard
from mooncake_k8s.common import defaults as d


@click.group()
@click.version_option(package_name="mooncake-k8s")
def main() -> None:
    """Mooncake on Kubernetes: KV-cache-centric disaggregated LLM serving."""


@main.group()
def store() -> None:
    """The distributed KV cache store: master, storage nodes, inspection."""


@store.command("master")
@click.option("--host", envvar="MOONCAKE_MASTER_HOST", default="127.0.0.1", show_default=True,
              show_envvar=True, help="Address to bind the gRPC server to.")
@click.option("--port", envvar="MOONCAKE_MASTER_PORT", default=d.MASTER_PORT, show_default=True,
              show_envvar=True, type=click.IntRange(0, 65535))
@click.option("--metrics-port", envvar="MOONCAKE_MASTER_METRICS_PORT",
              default=d.MASTER_METRICS_PORT, show_default=True, show_envvar=True,
              type=click.IntRange(-1, 65535),
              help="Prometheus /metrics port on the same host; 0 = any free port, -1 = off.")
@_token_opt
@click.option("--high-watermark", envvar="MOONCAKE_HIGH_WATERMARK", default=d.HIGH_WATERMARK,
              show_default=True, show_envvar=True, type=click.FloatRange(0.05, 1.0),
              help="Start evicting a segment above this fraction used.")
@click.option("--low-watermark", envvar="MOONCAKE_LOW_WATERMARK", default=d.LOW_WATERMARK,
              show_default=True, show_envvar=True, type=click.FloatRange(0.0, 1.0),
              help="Evict down to this fraction.")
@click.option("--lease-ms", envvar="MOONCAKE_LEASE_MS", default=d.LEASE_MS, show_default=True,
              show_envvar=True, type=click.IntRange(1, 600_000),
              help="Default read lease granted by lookups.")
@click.option("--put-timeout-s", envvar="MOONCAKE_PUT_TIMEOUT_S", default=d.PUT_TIMEOUT_S,
              show_default=True, show_envvar=True, type=click.FloatRange(0.1),
              help="A put not ended within this time is revoked and its space reclaimed.")
@click.option("--put-claim-s", envvar="MOONCAKE_PUT_CLAIM_S", default=1.0, show_default=True,
              show_envvar=True, type=click.FloatRange(0.01),
              help="How long a pending put keeps other writers of its key away (plus time for "
                   "its size); a crashed writer blocks its key no longer.")
@click.option("--state-dir", envvar="MOONCAKE_MASTER_STATE_DIR", default=None, show_envvar=True,
              type=click.Path(file_okay=False),
              help="Directory for the registered nodes' ids, so a restarted master knows whom "
                   "to wait for before answering (without it: always the whole grace period).")
@click.option("--recovery-grace-s", envvar="MOONCAKE_RECOVERY_GRACE_S", default=d.RECOVERY_GRACE_S,
              show_default=True, show_envvar=True, type=click.FloatRange(0.0),
              help="After a restart, answer UNAVAILABLE at most this long while storage nodes "
                   "re-register; 0 = answer at once.")
@click.option("--node-timeout-s", envvar="MOONCAKE_NODE_TIMEOUT_S", default=d.NODE_TIMEOUT_S,
              show_default=True, show_envvar=True, type=click.FloatRange(0.5),
              help="A node silent this long is dead; its replicas are dropped.")
@click.option("--max-object-size", envvar="MOONCAKE_MAX_OBJECT_SIZE", default="1GiB",
              show_default=True, show_envvar=True, type=SIZE)
@click.option("--fast-port", envvar="MOONCAKE_MASTER_FAST_PORT", default=0, show_default=True,
              show_envvar=True, type=click.IntRange(-1, 65535),
              help="Port of the fast path for puts and lookups (a lean protocol beside gRPC; "
                   "clients find it by themselves); 0 = any free port, -1 = off.")
@click.option("--metadata-backend", envvar="MOONCAKE_METADATA_BACKEND", default="embedded",
              show_default=True, show_envvar=True, type=click.Choice(["embedded", "redis"]),
              help="embedded: one master. redis: several masters, one leads by a lease in "
                   "Redis; the others stand by and take over.")
@click.option("--redis-url", envvar="MOONCAKE_REDIS_URL", default="", show_envvar=True,
              help="Redis for --metadata-backend redis, e.g. redis://:password@redis:6379/0.")
@click.option("--advertise", envvar="MOONCAKE_MASTER_ADVERTISE", default="", show_envvar=True,
              help="host:port clients reach this master at (the leader address standbys "
                   "hand out); default: the bound address.")
@click.option("--ha-prefix", envvar="MOONCAKE_HA_PREFIX", default="mooncake", show_default=True,
              show_envvar=True, help="Prefix of this cluster's keys in Redis.")
@click.option("--ha-lease-ms", envvar="MOONCAKE_HA_LEASE_MS", default=d.HA_LEASE_MS,
              show_default=True,
              show_envvar=True, type=click.IntRange(200, 60_000),
              help="Leader lease; a dead leader is replaced about this long after it stopped.")
@click.option("--tenant-quota", "tenant_quota", multiple=True, envvar="MOONCAKE_TENANT_QUOTAS",
              show_envvar=True, metavar="NAME=DRAM[,SSD]",
              help="A tenant's share of the pool, e.g. acme=1GiB,4GiB (repeat per tenant; an "
                   "empty NAME is the shared tenant, '-' leaves a tier unlimited). A tenant "
                   "over it evicts its own coldest objects; unnamed tenants are unlimited.")
@click.option("--fanout/--no-fanout", envvar="MOONCAKE_FANOUT", default=False,
              show_default=True, show_envvar=True,
              help="Hot-object fan-out: an object read often from hosts without a replica "
                   "gains one there (free room only, never evicting; the first evicted once "
                   "cool).")
@click.option("--fanout-threshold", envvar="MOONCAKE_FANOUT_THRESHOLD", default=4,
              show_default=True, show_envvar=True, type=click.IntRange(1),
              help="Lookups of an object per window from one host that add a replica there.")
@click.option("--fanout-window", "fanout_window_s", envvar="MOONCAKE_FANOUT_WINDOW",
              default=10.0, show_default=True, show_envvar=True, type=click.FloatRange(0.1),
              help="Seconds of the read-count window; an extra replica unread this long is "
                   "cool.")
@click.option("--fanout-max-replicas", envvar="MOONCAKE_FANOUT_MAX_REPLICAS", default=4,
              show_default=True, show_envvar=True, type=click.IntRange(2, 16),
              help="Most replicas of one object, its own included.")
@click.option("--allow-any-address", is_flag=True,
              help="Permit binding every interface (0.0.0.0, :: in any spelling).")
@_with_logs
def store_master(
    host: str, port: int, metrics_port: int, token: str, high_watermark: float,
    low_watermark: float, lease_ms: int, put_timeout_s: float, put_claim_s: float,
    state_dir: str | None, recovery_grace_s: float, node_timeout_s: float,
    max_object_size: int, fast_port: int, metadata_backend: str, redis_url: str,
    advertise: str,
    ha_prefix: str, ha_lease_ms: int, tenant_quota: tuple[str, ...], allow_any_address: bool,
    log_level: str, log_format: str,
    fanout: bool = False, fanout_threshold: int = 4, fanout_window_s: float = 10.0,
    fanout_max_replicas: int = 4,
) -> None:
    """Run the store master (metadata, allocation, leases, eviction; never in the data path)."""
    host = _check_bind(host, allow_any_address)
    quotas = _tenant_quotas(tenant_quota)
    if metadata_backend == "redis" and not redis_url:
        raise click.BadParameter("--metadata-backend redis needs a Redis URL",
                                 param_hint="--redis-url")
    if low_watermark >= high_watermark:
        raise click.BadParameter("must be below --high-watermark", param_hint="--low-watermark")
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.store.master import MasterConfig, run_master

    setup_logging("store-master", log_level, log_format == "json")
    _warn_no_token(token)
    run_master(
        MasterConfig(
            host=host, port=port, token=token,
            metrics_port=None if metrics_port < 0 else metrics_port,
            high_watermark=high_watermark, low_watermark=low_watermark, lease_ms=lease_ms,
            put_timeout_s=put_timeout_s, put_claim_s=put_claim_s, state_dir=state_dir,
            recovery_grace_s=recovery_grace_s, node_timeout_s=node_timeout_s,
            max_object_size=max_object_size, fast_port=fast_port,
            fanout=fanout, fanout_threshold=fanout_threshold,
            fanout_window_s=fanout_window_s, fanout_max_replicas=fanout_max_replicas,
            metadata_backend=metadata_backend,
            redis_url=redis_url, advertise=advertise, ha_prefix=ha_prefix,
            ha_lease_ms=ha_lease_ms, tenant_quotas=quotas,
        )
    )


def _tenant_quotas(flags: tuple[str, ...]) -> dict[str, tuple[int | None, int | None]]:
    """`--tenant-quota` values -> tenant: (DRAM, SSD); a bad one is a usage error naming it."""
    from mooncake_k8s.common.errors import InvalidArgument
    from mooncake_k8s.store.master.quotas import parse_quota_flag

    out: dict[str, tuple[int | None, int | None]] = {}
    for flag in flags:
        for one in flag.split() if " " in flag.strip() else [flag]:
            try:
                name, q = parse_quota_flag(one)
            except InvalidArgument as e:
                raise click.BadParameter(str(e), param_hint="--tenant-quota") from None
            if name in out:
                raise click.BadParameter(f"tenant {name!r} is named twice",
                                         param_hint="--tenant-quota")
            out[name] = (q.dram, q.ssd)
    return out


@store.command("node")
@click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=d.MASTER_ADDRESS,
              show_default=True, show_envvar=True,
              help="Master address host:port, or the comma-separated list of an HA group.")
@click.option("--node-id", envvar="MOONCAKE_NODE_ID", default=None, show_envvar=True,
              help="Unique node id [default: hostname-pid].")
@click.option("--host", envvar="MOONCAKE_NODE_HOST", default="127.0.0.1", show_default=True,
              show_envvar=True, help="Address the transfer server binds to.")
@click.option("--port", envvar="MOONCAKE_NODE_PORT", default=0, show_default=True,
              show_envvar=True, type=click.IntRange(0, 65535), help="Transfer port; 0 = any.")
@click.option("--advertise-host", envvar="MOONCAKE_NODE_ADVERTISE_HOST", default=None,
              show_envvar=True, help="Address clients dial, if not --host (e.g. the pod IP).")
@click.option("--dram-size", envvar="MOONCAKE_DRAM_SIZE", default="1GiB", show_default=True,
              show_envvar=True, type=SIZE, help="Host DRAM to serve (shared memory).")
@click.option("--dram-segments", envvar="MOONCAKE_DRAM_SEGMENTS", default=1, show_default=True,
              show_envvar=True, type=click.IntRange(1, 64))
@click.option("--prefault/--no-prefault", envvar="MOONCAKE_NODE_PREFAULT", default=True,
              show_default=True, show_envvar=True,
              help="Allocate the DRAM at start, so puts never pay for page faults (uses the "
                   "whole --dram-size at once).")
@click.option("--ssd-dir", envvar="MOONCAKE_SSD_DIR", default=None, show_envvar=True,
              type=click.Path(file_okay=False), help="Directory for the SSD tier (optional).")
@click.option("--ssd-size", envvar="MOONCAKE_SSD_SIZE", default="0", show_default=True,
              show_envvar=True, type=SIZE)
@click.option("--metrics-port", envvar="MOONCAKE_NODE_METRICS_PORT", default=d.NODE_METRICS_PORT,
              show_default=True, show_envvar=True, type=click.IntRange(-1, 65535),
              help="Prometheus /metrics port; 0 = any free port, -1 = off.")
@_token_opt
@click.option("--allow-any-address", is_flag=True,
              help="Permit binding every interface (0.0.0.0, :: in any spelling).")
@_with_logs
def store_node(
    master: str, node_id: str | None, host: str, port: int, advertise_host: str | None,
    dram_size: int, dram_segments: int, prefault: bool, ssd_dir: str | None, ssd_size: int,
    metrics_port: int, token: str, allow_any_address: bool, log_level: str, log_format: str,
) -> None:
    """Run a storage node that serves DRAM (and optional SSD) segments to the transfer engine."""
    host = _check_bind(host, allow_any_address)
    if dram_size < 1 << 20:
        raise click.BadParameter("at least 1MiB", param_hint="--dram-size")
    if ssd_size and not ssd_dir:
        raise click.BadParameter("--ssd-size needs --ssd-dir", param_hint="--ssd-size")
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.store.node import NodeConfig, run_node

    setup_logging("store-node", log_level, log_format == "json")
    _warn_no_token(token)
    run_node(
        NodeConfig(
            master=master, node_id=node_id or f"{socket.gethostname()}-{os.getpid()}",
            token=token, host=host, port=port, advertise_host=advertise_host,
            dram_size=dram_size, dram_segments=dram_segments, prefault=prefault,
            ssd_dir=ssd_dir,
            ssd_size=ssd_size, metrics_port=None if metrics_port < 0 else metrics_port,
        )
    )


@store.command("stats")
@click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=d.MASTER_ADDRESS,
              show_default=True,
              show_envvar=True)
@_token_opt
def store_stats(master: str, token: str) -> None:
    """Print the master's view of the cluster as JSON."""
    from google.protobuf.json_format import MessageToDict

    from mooncake_k8s.common.errors import StoreError
    from mooncake_k8s.store.client import StoreClient

    try:
        with StoreClient(master, token) as c:
            click.echo(json.dumps(MessageToDict(c.stats()), indent=2))
    except StoreError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


@store.command("demo")
@click.option("--size", default="4MiB", show_default=True, type=SIZE, help="Object size.")
def store_demo(size: int) -> None:
    """Start a local store, put and get an object over shm and tcp, print stats, stop."""
    from mooncake_k8s.store.demo import run_demo

    run_demo(size, click.echo)


def _register_serving() -> None:
    from mooncake_k8s.cli.sched import COMMANDS as SCHED_COMMANDS
    from mooncake_k8s.cli.serving import COMMANDS

    for command in [*COMMANDS, *SCHED_COMMANDS]:
        main.add_command(command)


_register_serving()


def _register_operator() -> None:
    from mooncake_k8s.operator.cli import COMMANDS as OPERATOR_COMMANDS

    for command in OPERATOR_COMMANDS:
        main.add_command(command)


_register_operator()
main.add_command(_sidecar_command)
main.add_command(_p2p_command)
# Last, over the whole tree: a server's start-up errors become one line (flag, value), exit 2.
guard(main)
