"""`mooncake sidecar`: the pod's transfer sidecar (see `mooncake_k8s.sidecar.server`)."""

from __future__ import annotations

import click

from mooncake_k8s.cli.options import MASTERS, SIZE, _token_opt, _warn_no_token, _with_logs
from mooncake_k8s.common import defaults as d


@click.command("sidecar")
@click.option("--socket", "socket_path", envvar="MOONCAKE_SIDECAR_SOCKET",
              default="/run/mooncake/sidecar.sock", show_default=True, show_envvar=True,
              type=click.Path(dir_okay=False),
              help="Unix socket to serve (created with mode 0600; its folder is created 0700).")
@click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS, default=d.MASTER_ADDRESS,
              show_default=True,
              show_envvar=True, help="Store master address host:port.")
@_token_opt
@click.option("--staging-size", envvar="MOONCAKE_SIDECAR_STAGING_SIZE", default="256MiB",
              show_default=True, show_envvar=True, type=SIZE,
              help="Shared-memory staging segment that workers map (/dev/shm).")
@click.option("--slots", envvar="MOONCAKE_SIDECAR_SLOTS", default=8, show_default=True,
              show_envvar=True, type=click.IntRange(1, 1024),
              help="Staging is split into this many slots, one per client connection: the "
                   "bound on concurrent connections, and a slot is the most one request moves.")
@click.option("--transport", envvar="MOONCAKE_SIDECAR_TRANSPORT", default="auto",
              show_default=True, show_envvar=True, type=click.Choice(["auto", "shm", "tcp"]),
              help="How the sidecar's store client reaches storage nodes.")
@click.option("--store-timeout-s", envvar="MOONCAKE_SIDECAR_STORE_TIMEOUT_S", default=1.5,
              show_default=True, show_envvar=True, type=click.FloatRange(0.05),
              help="Bound on each store call; keep it below the clients' reply timeout (2 s).")
@click.option("--idle-timeout-s", envvar="MOONCAKE_SIDECAR_IDLE_TIMEOUT_S", default=600.0,
              show_default=True, show_envvar=True, type=click.FloatRange(0.1),
              help="A connection silent this long is closed and its slot freed.")
@_with_logs
def sidecar(
    socket_path: str, master: str, token: str, staging_size: int, slots: int, transport: str,
    store_timeout_s: float, idle_timeout_s: float, log_level: str, log_format: str,
) -> None:
    """Run the transfer sidecar: a pod's store client and staging memory, behind a Unix socket."""
    from mooncake_k8s.common.errors import InvalidArgument
    from mooncake_k8s.common.logs import setup_logging
    from mooncake_k8s.sidecar.server import SidecarConfig, run_sidecar

    setup_logging("sidecar", log_level, log_format == "json")
    _warn_no_token(token)
    try:
        cfg = SidecarConfig(
            master=master, token=token, socket_path=socket_path, staging_size=staging_size,
            slots=slots, transport=transport, store_timeout_s=store_timeout_s,
            idle_timeout_s=idle_timeout_s,
        )
    except InvalidArgument as e:
        raise click.UsageError(str(e)) from e
    try:
        run_sidecar(cfg)
    except InvalidArgument as e:  # the socket is held by a live sidecar, or is not a socket
        raise click.ClickException(str(e)) from e
