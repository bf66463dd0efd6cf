"""The any-address guard as every server command applies it, in real `mooncake` processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.testing import StoreCluster

SERVERS = [
    ["store", "master", "--port", "0", "--metrics-port", "-1"],
    ["store", "node", "--port", "0", "--metrics-port", "-1"],
    ["prefill", "--port", "0"],
    ["decode", "--port", "0"],
    ["conductor", "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
]


def _mooncake(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": "t"}
    return subprocess.run(
        [sys.executable, "-m", "mooncake_k8s.cli", *args], capture_output=True, text=True,
        timeout=timeout, env=env,
    )


@pytest.mark.parametrize("host", ["::0", "0:0:0:0:0:0:0:0", "0", "0x0"])
@pytest.mark.parametrize("cmd", SERVERS, ids=lambda c: " ".join(c[:2]).split(" -")[0])
def test_every_server_refuses_any_address_spellings(cmd: list[str], host: str) -> None:
    r = _mooncake(*cmd, "--host", host)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to bind every interface" in r.stderr
    assert "--allow-any-address" in r.stderr


@pytest.mark.parametrize("host", ["0", "0:0:0:0:0:0:0:0"])
def test_master_and_node_bind_any_address_when_allowed(host: str) -> None:
    """A legacy spelling that gRPC itself would reject ("0") still binds once allowed."""
    port = free_port()
    with StoreCluster(token="t", master_port=port) as cluster:
        cluster.start_master("--host", host, "--allow-any-address")
        cluster.start_node("n0", "8MiB", "--host", host, "--allow-any-address",
                           "--advertise-host", "127.0.0.1")
        with StoreClient(f"127.0.0.1:{port}", "t", timeout_s=5) as c:
            c.put("k", b"bytes on every interface")
            assert bytes(c.get("k")) == b"bytes on every interface"
