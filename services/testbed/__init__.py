"""A multi-host test bed on one machine (tests and benchmarks): each component on its own
emulated host, with its own address, IPC namespace and shaped link (docs/testbed.md).

Not part of the product: nothing in the product imports it (the top layer of the import
contract), and it needs root.
"""

from mooncake_k8s.testbed.bed import Host, Testbed, TestbedUnavailable, check_support

__all__ = ["Host", "Testbed", "TestbedUnavailable", "check_support"]
