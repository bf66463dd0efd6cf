"""A DRAM segment of the pool served from inside another process: the store's embedding API.

A decode worker serves the KV that prefill writes for it from its own memory (the plan's
`write_segment`), so its reads are local copies, not transfers. That is a storage node living
in the worker's process; this module is the narrow, public face of it, so the worker depends
on what the store promises (start, readiness, the segment's name, stop), not on how a storage
node is built. The store's import contract (tests/unit/test_import_contract.py) forbids other
components to import the node itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_k8s.store.node.server import NodeConfig, StorageNode


@dataclass(frozen=True)
class LocalSegmentConfig:
    master: str
    """Master address, or a comma-separated list of the masters (HA)."""
    owner_id: str
    """Unique in the cluster (and stable across restarts of the owner): names the segment."""
    size: int
    """Bytes of DRAM (POSIX shared memory) to serve."""
    token: str = ""
    host: str = "127.0.0.1"
    """Address the segment's transfer server binds to."""
    advertise_host: str | None = None
    """Address readers should dial when it differs from `host` (e.g. a pod IP)."""


class LocalSegment:
    """One DRAM segment registered with the master and served to the cluster."""

    def __init__(self, config: LocalSegmentConfig) -> None:
        self._node = StorageNode(NodeConfig(
            master=config.master, node_id=config.owner_id, token=config.token,
            host=config.host, advertise_host=config.advertise_host, dram_size=config.size,
        ))

    @property
    def name(self) -> str:
        """The segment's name in the pool (what a KV plan's `write_segment` names)."""
        return f"{self._node.config.node_id}-dram-0"

    def start(self) -> None:
        self._node.start()

    def registered(self) -> bool:
        """Whether the master knows the segment (writes to it can be placed)."""
        return self._node.wait_registered(0)

    def stop(self) -> None:
        self._node.stop()
