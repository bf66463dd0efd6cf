"""free_service_port hands each port out once: children started together bind theirs later."""

from __future__ import annotations

import socket

from mooncake_k8s.common.netutil import SERVICE_PORTS, free_service_port


def test_ports_handed_out_together_are_distinct_and_in_the_service_range() -> None:
    ports = [free_service_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
    assert all(SERVICE_PORTS[0] <= p <= SERVICE_PORTS[1] for p in ports)


def test_a_port_in_use_is_not_handed_out() -> None:
    held = []
    try:
        for _ in range(50):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_service_port()))
            s.listen()
            held.append(s)
        in_use = {s.getsockname()[1] for s in held}
        assert not in_use & {free_service_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()
