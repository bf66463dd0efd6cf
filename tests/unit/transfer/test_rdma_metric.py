"""`mooncake_transfer_rdma_info` says plainly whether RDMA is unavailable, present but unused
("untested"), or in use, and that the RDMA transport has not been tested on hardware."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mooncake_k8s.engine import EngineConfig
from mooncake_k8s.transfer.rdma import (
    RDMA_STATES,
    RdmaInfoCollector,
    RdmaStatus,
    detect_rdma,
    rdma_state,
)
from mooncake_k8s.worker.base import Worker, WorkerConfig

SERIES = re.compile(r'^mooncake_transfer_rdma_info\{hardware_tested="(\w+)",reason="([^"]*)",'
                    r'state="(\w+)"\} ([01])\.0$')


def series(registry: CollectorRegistry) -> dict[str, tuple[str, str, int]]:
    """state -> (hardware_tested, reason, value)."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        m = SERIES.match(line)
        if m:
            out[m[3]] = (m[1], m[2], int(m[4]))
    return out


@pytest.mark.parametrize(("available", "transport", "state"), [
    (False, "auto", "unavailable"),
    (False, "rdma", "unavailable"),
    (True, "auto", "untested"),
    (True, "tcp", "untested"),
    (True, "rdma", "active"),
])
def test_one_state_is_current_and_all_say_untested_on_hardware(
        available: bool, transport: str, state: str) -> None:
    status = RdmaStatus(available, "why: a reason", ("mlx5_0",) if available else ())
    assert rdma_state(status, transport) == state
    registry = CollectorRegistry()
    registry.register(RdmaInfoCollector(lambda: transport, lambda: status))
    got = series(registry)
    assert set(got) == set(RDMA_STATES)
    assert {s for s, (_, _, v) in got.items() if v == 1} == {state}
    assert all(tested == "false" and reason == "why: a reason"
               for tested, reason, _ in got.values())


def test_a_worker_exports_it_with_this_machines_state() -> None:
    found = detect_rdma()
    worker = Worker(WorkerConfig(role="prefill", master="127.0.0.1:1", engine=EngineConfig()))
    try:
        got = series(worker.registry)
    finally:
        worker.store.close()
    expected = "untested" if found.available else "unavailable"
    assert {s for s, (_, _, v) in got.items() if v == 1} == {expected}
    assert got[expected][1] == found.reason[:200]
