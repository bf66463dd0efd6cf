"""RDMA detection, selection state, and the metric that says how far to trust it.

The RDMA data path (`rdma_verbs`, pyverbs RC queue pairs, one-sided READ/WRITE) exists but is
UNTESTED ON HARDWARE: no machine it was written or tested on had an RDMA device or could create
a soft-RoCE one. So it is never selected automatically: only an explicit `rdma` transport
(`--transfer-protocol rdma`, `TransferEngine(transport="rdma")`) uses it, and that refuses at
start, with `detect_rdma`'s reason, where no device or no pyverbs exists.

`mooncake_transfer_rdma_info` (`RdmaInfoCollector`) reports one of `RDMA_STATES`:
"unavailable" (no device or no pyverbs), "untested" (both present, RDMA not in use) or
"active" (in use); `hardware_tested="false"` on every series until it has run on hardware.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

SYSFS_IB = "/sys/class/infiniband"
RDMA_STATES = ("unavailable", "untested", "active")
HARDWARE_TESTED = False
"""Flip (and drop the README's warning) once the transport has run end to end on a device."""


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


_lock = threading.Lock()
_status: RdmaStatus | None = None


def cached_rdma_status() -> RdmaStatus:
    """`detect_rdma()` once per process (devices do not come and go under a running server)."""
    global _status
    with _lock:
        if _status is None:
            _status = detect_rdma()
        return _status


def rdma_state(status: RdmaStatus, transport: str) -> str:
    """The `RDMA_STATES` entry for a process whose transfer engine runs `transport`."""
    if not status.available:
        return "unavailable"
    return "active" if transport == "rdma" else "untested"


class RdmaInfoCollector:
    """`mooncake_transfer_rdma_info{state, hardware_tested, reason}`: 1 on the current state's
    series, 0 on the others. Register it on the registry of any process that runs a transfer
    engine or server; `transport` returns what that engine runs ("auto", "tcp", "rdma"...)."""

    def __init__(self, transport: Callable[[], str],
                 status: Callable[[], RdmaStatus] = cached_rdma_status) -> None:
        self._transport = transport
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._status()
        state = rdma_state(status, self._transport())
        fam = GaugeMetricFamily(
            "mooncake_transfer_rdma_info",
            "RDMA transport state (1 = current): unavailable (no device or pyverbs), untested "
            "(present, not in use) or active. hardware_tested=false: the RDMA transport has "
            "never run on RDMA hardware.",
            labels=["state", "hardware_tested", "reason"],
        )
        tested = "true" if HARDWARE_TESTED else "false"
        for s in RDMA_STATES:
            fam.add_metric([s, tested, status.reason[:200]], 1.0 if s == state else 0.0)
        yield fam
