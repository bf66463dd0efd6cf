"""The storage node: a process that serves DRAM (and SSD) segments to the transfer engine and
follows the master's commands (`server`). Other processes embed a segment through `store.local`.
"""

from mooncake_k8s.store.node.server import NodeConfig, StorageNode, run_node

__all__ = ["NodeConfig", "StorageNode", "run_node"]
