"""RDMA detection.

There is no RDMA data path yet: this module only finds out whether an RDMA device and the
`pyverbs` bindings are present, so the engine can say clearly why it uses TCP. Untested against
real hardware: no RDMA device exists where this was written. When a device is present the
engine still uses TCP and logs that the RDMA path is not implemented.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

SYSFS_IB = "/sys/class/infiniband"


@dataclass(frozen=True)
class RdmaStatus:
    available: bool
    reason: str
    devices: tuple[str, ...] = ()


def detect_rdma(sysfs: str = SYSFS_IB) -> RdmaStatus:
    """Whether RDMA devices and pyverbs are present; `reason` says why not (or what exists)."""
    try:
        devices = tuple(sorted(os.listdir(sysfs)))
    except FileNotFoundError:
        return RdmaStatus(False, f"no RDMA devices ({sysfs} does not exist)")
    except OSError as e:
        return RdmaStatus(False, f"cannot list {sysfs}: {e.strerror or e}")
    if not devices:
        return RdmaStatus(False, f"no RDMA devices in {sysfs}")
    try:
        importlib.import_module("pyverbs")
    except Exception as e:  # ImportError, or a broken native library
        return RdmaStatus(False, f"pyverbs not importable ({type(e).__name__}: {e})", devices)
    return RdmaStatus(True, f"RDMA devices {', '.join(devices)} with pyverbs", devices)
