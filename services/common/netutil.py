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


#: Ports this process handed out lately, with when: a port is free for us only once whoever we
#: gave it to has had time to bind it.
_HANDED_OUT: dict[int, float] = {}
_HANDED_OUT_TTL_S = 300.0


def free_service_port(host: str = "127.0.0.1") -> int:
    """A free port for a server another program will bind later (an engine child). Picked
    outside the ephemeral range, so the gap between our check and its bind is not a race with
    every connection on the host (seen: an SGLang child lost its port to one). A port handed out
    in the last few minutes is never handed out again by this process: several children started
    together have not bound theirs yet, and two of them given one port fail (seen in CI: a
    decode's health port equal to a sibling's)."""
    import random
    import time

    now = time.monotonic()
    for port, at in list(_HANDED_OUT.items()):
        if now - at > _HANDED_OUT_TTL_S:
            del _HANDED_OUT[port]
    for _ in range(200):
        port = random.randint(*SERVICE_PORTS)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT[port] = now
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
