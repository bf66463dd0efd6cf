"""Small socket helpers shared by servers, tests and benchmarks."""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Below Linux's default ephemeral range (32768-60999), where outgoing connections and
#: "any free port" binds of other programs land.
SERVICE_PORTS = (20000, 32000)


def free_service_port(host: str = "127.0.0.1") -> int:
    """A free port for a server another program will bind later (an engine child). Picked
    outside the ephemeral range, so the gap between our check and its bind is not a race with
    every connection on the host (seen: an SGLang child lost its port to one)."""
    import random

    for _ in range(200):
        port = random.randint(*SERVICE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def local_host_id() -> str:
    """Identifies this host's shared-memory domain: equal ids mean /dev/shm is shared.

    Boot id plus the IPC namespace inode, so two containers on one node that do not share
    /dev/shm get different ids and fall back to TCP instead of failing to map.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = ""
    return f"{boot}/{ipc}"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
