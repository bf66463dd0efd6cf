"""The Conductor's load gauges, set from the instances' load reports at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.store.testing import metric_value


def _decode(name: str, held: int, waiting_tokens: int, ready: bool = True) -> Instance:
    rep = pb.LoadReport(instance_id=name, role="decode", ready=ready, running=3, waiting=2,
                        kv_capacity_tokens=10_000, kv_free_tokens=10_000 - held,
                        queued_tokens=waiting_tokens)
    return Instance(name, "decode", None, rep, healthy=True)  # type: ignore[arg-type]


def test_decode_load_is_kv_held_plus_tokens_waiting_over_instances_in_rotation() -> None:
    m = ConductorMetrics()
    prefill = Instance("p0", "prefill", None,  # type: ignore[arg-type]
                       pb.LoadReport(role="prefill", ready=True, queued_tokens=700), healthy=True)
    decodes = [_decode("d0", 4000, 300), _decode("d1", 1000, 0),
               _decode("d2", 9000, 900, ready=False)]  # not ready: leaving, not counted
    m.observe_pools([prefill], decodes)
    text = generate_latest(m.registry).decode()
    assert metric_value(text, "mooncake_conductor_decode_load_tokens") == 5300
    # Tokens, not the count of running sequences it used to be.
    assert metric_value(text, "mooncake_conductor_queue_tokens", 'role="decode"') == 300
    assert metric_value(text, "mooncake_conductor_queue_tokens", 'role="prefill"') == 700
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="decode",state="unready"') == 1


def test_no_decode_instance_reads_as_zero_load() -> None:
    m = ConductorMetrics()
    m.observe_pools([], [])
    text = generate_latest(m.registry).decode()
    assert "mooncake_conductor_decode_load_tokens 0.0" in text


def test_instances_by_state_tell_unreachable_from_unready() -> None:
    """A partitioned instance (its polls time out) reads `unreachable`, apart from one that
    answers but is not ready; the reroute counter exists before any partition."""
    m = ConductorMetrics()
    ready = Instance("p0", "prefill", None,  # type: ignore[arg-type]
                     pb.LoadReport(role="prefill", ready=True), healthy=True)
    silent = Instance("p1", "prefill", None,  # type: ignore[arg-type]
                      pb.LoadReport(role="prefill", ready=True), healthy=False, unreachable=True)
    loading = Instance("p2", "prefill", None,  # type: ignore[arg-type]
                       pb.LoadReport(role="prefill", ready=False), healthy=True)
    m.observe_pools([ready, silent, loading], [])
    text = generate_latest(m.registry).decode()
    for state, n in (("ready", 1), ("unreachable", 1), ("unready", 1)):
        assert metric_value(text, "mooncake_conductor_instances",
                            f'role="prefill",state="{state}"') == n, state
    assert metric_value(text, "mooncake_conductor_instances",
                        'role="decode",state="unreachable"') == 0
    # Exported before the first partition (labels as exported: sorted by name).
    assert ('mooncake_conductor_reroutes_total{cause="unreachable",role="prefill"} 0.0'
            in text), text
