"""Publish a directory to the P2P store and fetch it from peers.

Keys: `p2p/<name>#manifest` holds the current manifest (`manifest.Manifest.encode`), and chunk
i of the manifest with digest D is `p2p/<name>#<D[:16]>/<i>` (a chunk's key names the manifest
it belongs to, so a republished directory never mixes with the old one's chunks).

`get` is resumable and idempotent: files are written into `<file>.p2p-part` at each chunk's
offset and renamed into place once every chunk of the file is written (after fsync), and a
rerun verifies what is there already (a complete file, or the chunks of a part file) against
the manifest before fetching only what is missing or wrong.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mooncake_k8s.common.errors import InvalidArgument, ObjectExists, ObjectNotFound, StoreError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.p2p.fetch import fetch_all
from mooncake_k8s.store.p2p.holders import Counters, Holders
from mooncake_k8s.store.p2p.manifest import (
    DEFAULT_CHUNK,
    Manifest,
    build,
    check_name,
    chunk_digest,
    decode,
)

log = logging.getLogger(__name__)


def manifest_key(name: str) -> str:
    return f"p2p/{check_name(name)}#manifest"


def chunk_key(man: Manifest, index: int) -> str:
    return f"p2p/{man.name}#{man.digest[:16]}/{index}"


def keep_segment(client: StoreClient, man: Manifest) -> str:
    """Where a fetcher keeps what it fetched: a DRAM segment on its own host (most free room
    first), so later fetchers on other hosts read from it; when its host has none (a pod in a
    cluster whose storage nodes are pods of their own), the emptiest DRAM segment that does not
    hold the first chunk yet, so each fetch still adds a holder on another storage node.
    "" when there is none."""
    segs = [s for s in client.segments() if s.tier == "dram"]
    mine = [s for s in segs if s.host_id == client._host_id]
    if not mine and man.chunks:
        info = client._lookup([chunk_key(man, 0)], use_cache=False)[0]
        held = {loc.segment.name for loc in info.replicas} if info else set()
        mine = [s for s in segs if s.name not in held]
    mine.sort(key=lambda s: s.used - s.size)
    return mine[0].name if mine else ""


def publish(directory: str | os.PathLike[str], name: str, *, client: StoreClient,
            chunk_size: int = DEFAULT_CHUNK, batch: int = 8, pin: bool = True) -> Manifest:
    """Cut every file under `directory` into chunks, store the chunks (this host's storage
    node first: the store's local-first placement), then the manifest. With `pin` both are
    soft-pinned: the store evicts them only when unpinned objects cannot make the room (without,
    they are cache like any object: a fetch that finds a chunk gone fails, and the caller falls
    back to its own source). Idempotent: chunks already stored are left alone. A different
    directory under the same name replaces the manifest and unpins the old chunks, which then
    go before anything pinned."""
    man = build(directory, name, chunk_size)
    _unpin_previous(client, man)
    root = Path(directory)
    todo = [(i, f, off) for f in man.files for i, off, _ in man.chunks_of(f)]
    keys = [chunk_key(man, i) for i, _, _ in todo]
    for start in range(0, len(todo), batch):
        part = todo[start:start + batch]
        pkeys = keys[start:start + batch]
        have = client.exists(pkeys)
        datas, put_keys = [], []
        for (i, f, off), k, h in zip(part, pkeys, have, strict=True):
            if h:
                continue
            data = _read_at(root / f.path, off, man.chunks[i].size)
            if chunk_digest(data) != man.chunks[i].digest:
                raise StoreError(f"{f.path!r} changed while it was being published")
            datas.append(data)
            put_keys.append(k)
        errs = client.batch_put(put_keys, datas, replicas=1) if put_keys else []
        for k, e in zip(put_keys, errs, strict=True):
            if e is not None and not isinstance(e, ObjectExists):
                raise StoreError(f"publishing chunk {k!r}: {e}") from e
        if pin:
            client.pin(pkeys)
    _put_manifest(client, man, pin)
    log.info("p2p published", extra={"p2p_name": name, "files": len(man.files),
                                      "chunks": len(man.chunks), "bytes": man.total_bytes})
    return man


def _unpin_previous(client: StoreClient, man: Manifest) -> None:
    """A different directory published under the same name: its predecessor's chunks become
    cache (evictable, e.g. to make room for the new ones); fetchers still reading the old
    version read them while they last, and a miss fails their get cleanly."""
    try:
        old = load_manifest(client, man.name)
    except (ObjectNotFound, InvalidArgument):
        return
    if old.digest != man.digest and old.chunks:
        client.pin([chunk_key(old, i) for i in range(len(old.chunks))], pin=False)


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


def _put_manifest(client: StoreClient, man: Manifest, pin: bool) -> None:
    key = manifest_key(man.name)
    raw = man.encode()
    try:
        client.put(key, raw, replicas=1)
    except ObjectExists:
        if bytes(client.get(key)) != raw:
            client.remove(key, force=True)
            client.put(key, raw, replicas=1)
    if pin:
        client.pin([key])


def load_manifest(client: StoreClient, name: str) -> Manifest:
    """The current manifest of `name`; ObjectNotFound when nothing is published under it."""
    try:
        raw = client.get(manifest_key(name))
    except ObjectNotFound:
        raise ObjectNotFound(f"nothing is published under p2p name {name!r}") from None
    return decode(raw)


@dataclass
class GetResult:
    manifest: Manifest
    counters: Counters


def get(name: str, directory: str | os.PathLike[str], *, client: StoreClient,
        parallel: int = 8, keep: bool = True, keep_on: str | None = None,
        shuffle: bool = True, on_chunk: Callable[[int], None] | None = None) -> GetResult:
    """Fetch `name` into `directory` from every host that holds its chunks, `parallel` chunks
    at a time, verifying each against the manifest before writing it; with `keep`, each chunk
    fetched from another host is added as a replica on `keep_on` (a segment name; by default
    `keep_segment`: this host's storage node), so this host serves it to later fetchers.
    `shuffle` fetches chunks in an order of this host's (see `fetch`), else in manifest order.
    `on_chunk(index)` is called after each chunk is written (progress; tests use it to kill
    a holder mid-transfer)."""
    if parallel < 1:
        raise InvalidArgument(f"parallel must be >= 1, got {parallel}")
    man = load_manifest(client, name)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    counters = Counters()
    if keep_on is None:
        keep_on = keep_segment(client, man) if keep else ""
    holders = Holders(client, keep_on if keep else "", counters)
    seed = zlib.crc32(client._host_id.encode()) if shuffle else None
    fetch_all(man, root, holders, lambda i: chunk_key(man, i), parallel=parallel, seed=seed,
              on_chunk=on_chunk)
    log.info("p2p fetched", extra={"p2p_name": name, "chunks": counters.fetched,
                                    "reused": counters.reused, "corrupt": counters.corrupt})
    return GetResult(man, counters)
