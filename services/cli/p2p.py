"""`mooncake p2p publish|get`: the P2P store from the command line (see store.p2p).

Exit codes: 0 done, 1 the store failed (nothing published under the name, no holder served a
chunk, the master unreachable), 2 bad arguments. `get` prints one JSON line saying what it
fetched from which hosts, so an init container's log shows whether peers served it.
"""

from __future__ import annotations

import json
import sys

import click

from mooncake_k8s.cli.options import MASTERS, SIZE, _token_opt
from mooncake_k8s.common import defaults as d

_master_opt = click.option("--master", envvar="MOONCAKE_MASTER", type=MASTERS,
                           default=d.MASTER_ADDRESS, show_default=True, show_envvar=True)


@click.group("p2p")
def p2p() -> None:
    """The P2P store: directories (model weights, checkpoints) shared between hosts."""


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2 if isinstance(e, ValueError) else 1)


@p2p.command("publish")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("name")
@_master_opt
@_token_opt
@click.option("--chunk-size", default="4MiB", show_default=True, type=SIZE,
              help="Chunk size (a chunk never spans two files).")
@click.option("--pin/--no-pin", default=True, show_default=True,
              help="Soft-pin the chunks (evicted only when nothing unpinned can make room); "
                   "--no-pin leaves them cache "
                   "(a fetch that misses one fails and its caller uses its own source).")
def p2p_publish(directory: str, name: str, master: str, token: str, chunk_size: int,
                pin: bool) -> None:
    """Publish DIRECTORY under NAME: its chunks are stored on this host's storage node."""
    from mooncake_k8s.common.errors import MooncakeError
    from mooncake_k8s.store.client import StoreClient
    from mooncake_k8s.store.p2p import publish

    try:
        with StoreClient(master, token) as c:
            man = publish(directory, name, client=c, chunk_size=chunk_size, pin=pin)
    except MooncakeError as e:
        _fail(e)
        return
    click.echo(json.dumps({"name": name, "digest": man.digest, "files": len(man.files),
                           "chunks": len(man.chunks), "bytes": man.total_bytes}))


@p2p.command("get")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False))
@_master_opt
@_token_opt
@click.option("--parallel", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Chunks fetched at once.")
@click.option("--keep/--no-keep", default=True, show_default=True,
              help="Keep a replica of each fetched chunk on this host's storage node, so "
                   "this host serves it to later fetchers.")
@click.option("--keep-on", default=None,
              help="Segment to keep the replicas on (default: this host's storage node, else "
                   "the emptiest one that does not hold the object yet).")
def p2p_get(name: str, directory: str, master: str, token: str, parallel: int,
            keep: bool, keep_on: str | None) -> None:
    """Fetch NAME into DIRECTORY from every host that holds it, verifying every chunk."""
    from mooncake_k8s.common.errors import MooncakeError
    from mooncake_k8s.store.client import StoreClient
    from mooncake_k8s.store.p2p import get

    try:
        with StoreClient(master, token) as c:
            got = get(name, directory, client=c, parallel=parallel, keep=keep,
                      keep_on=keep_on)
    except MooncakeError as e:
        _fail(e)
        return
    k = got.counters
    click.echo(json.dumps({"name": name, "digest": got.manifest.digest, "fetched": k.fetched,
                           "reused": k.reused, "corrupt": k.corrupt, "kept": k.kept,
                           "by_host": k.by_host}))
