"""`mooncake rdma-probe`: find the RDMA devices a pod can use and record them as JSON.

EXPERIMENTAL, like everything RDMA here: the record says which devices a pod sees, not what its
KV uses (TCP in this release; the operator's KVTransport condition says so).

Runs as an init container of prefill, decode and store pods when `rdma.enabled`. It asks
pyverbs (rdma-core's Python bindings) when they are importable and otherwise reads sysfs
(`/sys/class/infiniband`), which needs no library. A device counts as usable when one of its
ports is ACTIVE and the container has a uverbs device node (the device plugin mounts those
into pods that request its resource).

The record goes to stdout, to `--output` (a shared emptyDir the main container can read) and to
the termination log, where the kubelet copies it into the pod status for the operator's
RDMAReady condition (present only when the cluster asks for RDMA). It stays under the
kubelet's 4 KiB termination-message limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

Record = dict[str, Any]
_ACTIVE = 4  # IBV_PORT_ACTIVE
_MAX_MESSAGE = 4000


def _sysfs_devices(sys_root: Path) -> list[Record]:
    base = sys_root / "class" / "infiniband"
    devices = []
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        ports = []
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            state = _read(port / "state")  # e.g. "4: ACTIVE"
            ports.append({"port": int(port.name) if port.name.isdigit() else port.name,
                          "state": state.split(":", 1)[-1].strip() if state else "UNKNOWN",
                          "linkLayer": _read(port / "link_layer") or "unknown"})
        devices.append({"name": dev.name, "ports": ports})
    return devices


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _pyverbs_devices() -> list[Record] | None:
    """Devices as pyverbs sees them; None when pyverbs is not installed."""
    try:
        from pyverbs.device import Context, get_device_list  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        found = get_device_list()
    except Exception:  # pyverbs raises (PyverbsRDMAError) instead of listing no devices
        found = []
    devices = []
    for d in found:
        name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
        ports = []
        try:
            with Context(name=name) as ctx:
                for n in range(1, int(ctx.query_device().phys_port_cnt) + 1):
                    attr = ctx.query_port(n)
                    ports.append({"port": n,
                                  "state": "ACTIVE" if attr.state == _ACTIVE else str(attr.state),
                                  "linkLayer": "Ethernet" if attr.link_layer == 2
                                  else "InfiniBand"})
        except Exception as e:  # a device we cannot open is reported, not fatal
            ports.append({"port": 0, "state": f"ERROR {type(e).__name__}", "linkLayer": "?"})
        devices.append({"name": name, "ports": ports})
    return devices


def probe(sys_root: Path = Path("/sys"), dev_root: Path = Path("/dev"),
          use_pyverbs: bool = True) -> Record:
    via_pyverbs = _pyverbs_devices() if use_pyverbs else None
    devices = via_pyverbs if via_pyverbs is not None else _sysfs_devices(sys_root)
    uverbs = sorted(p.name for p in (dev_root / "infiniband").glob("uverbs*")) if (
        dev_root / "infiniband").is_dir() else []
    active = [d for d in devices if any(p["state"] == "ACTIVE" for p in d["ports"])]
    usable = bool(active) and (via_pyverbs is not None or bool(uverbs))
    if usable:
        reason = f"{len(active)} device(s) with an active port"
    elif not devices:
        reason = "no RDMA device found; KV transfers will use TCP"
    elif not active:
        reason = "RDMA devices found but no port is ACTIVE; KV transfers will use TCP"
    else:
        reason = ("RDMA devices visible but no /dev/infiniband/uverbs* in the container; "
                  "does the pod request the RDMA device-plugin resource?")
    return {
        "version": 1,
        "usable": usable,
        "method": "pyverbs" if via_pyverbs is not None else "sysfs",
        "devices": [{"name": d["name"], "ports": d["ports"]} for d in devices],
        "uverbs": uverbs,
        "reason": reason,
        "host": os.environ.get("MOONCAKE_POD_NAME") or socket.gethostname(),
    }


def compact(record: Record) -> str:
    """JSON that fits the termination message; per-port detail is dropped first if needed."""
    text = json.dumps(record, separators=(",", ":"), sort_keys=True)
    if len(text) <= _MAX_MESSAGE:
        return text
    slim = {**record, "devices": [{"name": d["name"], "active": any(
        p["state"] == "ACTIVE" for p in d["ports"])} for d in record["devices"]][:64]}
    text = json.dumps(slim, separators=(",", ":"), sort_keys=True)
    if len(text) > _MAX_MESSAGE:  # never cut JSON in half: drop the list, keep the verdict
        slim = {**record, "devices": [], "uverbs": [],
                "reason": record["reason"][:500] + f" ({len(record['devices'])} devices)"}
        text = json.dumps(slim, separators=(",", ":"), sort_keys=True)
    return text


def write_outputs(record: Record, output: Path | None, termination_log: Path | None) -> None:
    text = compact(record)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_suffix(output.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(output)  # readers never see half a record
    if termination_log is not None:
        # Outside a pod (or not writable) there is no termination log; stdout has the record.
        with contextlib.suppress(OSError):
            termination_log.write_text(text)
