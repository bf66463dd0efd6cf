"""Replica-level access for callers that pick the replica themselves.

The client's own reads always go to the nearest replica, which is right for KV blocks and wrong
for the P2P store: N fetchers would all read the same holder. So the P2P store looks up replica
lists, chooses a holder itself (`store.p2p.holders`), reads it, verifies the bytes against its
manifest and keeps a replica on its own host. These are the public pieces it uses, kept beside
the client rather than in it (the client module is at its size limit).
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_k8s.common.errors import TransferError
from mooncake_k8s.store.client.failover import PeerHealth
from mooncake_k8s.store.client.keeper import Keeper
from mooncake_k8s.store.wire import Location, ObjectInfo
from mooncake_k8s.transfer import Peer, ReadOp, TransferEngine


class ReplicaAccess:
    """Mixed into `StoreClient`, which provides the attributes and the two methods below."""

    engine: TransferEngine
    _host_id: str
    _health: PeerHealth
    _keeper: Keeper

    def _lookup(self, keys: Sequence[str], use_cache: bool = True) -> list[ObjectInfo | None]:
        raise NotImplementedError

    def _failed(self, peer: Peer) -> None:
        raise NotImplementedError

    @property
    def host_id(self) -> str:
        """The host this client reads and places for (nearness, local-first placement)."""
        return self._host_id

    def locate(self, keys: Sequence[str]) -> list[ObjectInfo | None]:
        """The master's current replica lists for `keys` (never the location cache)."""
        return self._lookup(keys, use_cache=False)

    def suspect(self, loc: Location) -> bool:
        """Whether `loc`'s peer failed a transfer lately (this client reads it last)."""
        return self._health.suspect(loc.peer.address)

    def read_replica(self, loc: Location, view: memoryview) -> None:
        """Read the replica at `loc` into `view`, unverified (the caller verifies); raises
        TransferError and marks the peer suspect when it fails."""
        try:
            self.engine.read(loc.peer, [ReadOp(loc.segment, loc.offset, view)])
        except TransferError:
            self._failed(loc.peer)
            raise
        self._health.succeeded(loc.peer.address)

    def keep_replica(self, segment: str, key: str, info: ObjectInfo, view: memoryview) -> bool:
        """Add a replica of `key` (its bytes in `view`) on `segment`; False when it was not
        kept (the client counts why in `keep_failures`)."""
        return bool(self._keeper.keep(segment, [(key, info, view)]))
