"""Status aggregation from hand-built children, and the rdma-probe that feeds RDMAReady."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.operator import naming
from mooncake_k8s.operator.metrics import store_usage
from mooncake_k8s.operator.rdma_probe import compact, probe
from mooncake_k8s.operator.render import Rendered, render
from mooncake_k8s.operator.schema import ROLES
from mooncake_k8s.operator.schema_status import cluster_status_schema
from mooncake_k8s.operator.status import Observed, aggregate
from mooncake_k8s.operator.validation import validate, validate_cluster

Obj = dict[str, Any]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def workload(role: str, want: int, ready: int, updated: int | None = None,
             stale: bool = False) -> Obj:
    return {"metadata": {"name": f"demo-{role}", "generation": 3,
                         "labels": {naming.LABEL_COMPONENT: role}},
            "status": {"observedGeneration": 2 if stale else 3, "replicas": want,
                       "readyReplicas": ready,
                       "updatedReplicas": ready if updated is None else updated}}


def healthy(r: Rendered) -> dict[str, Obj]:
    return {role: workload(role, r.replicas[role], r.replicas[role]) for role in ROLES}


def pod(name: str, role: str, probe_record: Obj | None = None,
        waiting: str | None = None) -> Obj:
    st: Obj = {"containerStatuses": [{"name": role, "state": (
        {"waiting": {"reason": waiting}} if waiting else {"running": {}})}]}
    if probe_record is not None:
        st["initContainerStatuses"] = [{"name": "rdma-probe", "state": {"terminated": {
            "exitCode": 0, "message": json.dumps(probe_record)}}}]
    return {"metadata": {"name": name, "labels": {naming.LABEL_COMPONENT: role}}, "status": st}


def cond(status: Obj, typ: str) -> Obj:
    c: Obj = next(c for c in status["conditions"] if c["type"] == typ)
    return c


@pytest.fixture
def base(make_cluster: Callable[..., Obj]) -> tuple[Obj, Rendered]:
    c = validate_cluster(make_cluster({"roles": {"prefill": {"replicas": 2}}}))
    c["metadata"]["generation"] = 7
    return c, render(c)


def test_everything_ready(base: tuple[Obj, Rendered]) -> None:
    c, r = base
    usage = store_usage('mooncake_store_capacity_bytes{segment="a",tier="dram"} 1000\n'
                        'mooncake_store_capacity_bytes{segment="b",tier="ssd"} 3000\n'
                        'mooncake_store_used_bytes{segment="a",tier="dram"} 400\n'
                        'mooncake_store_lookups_total{result="hit"} 3\n'
                        'mooncake_store_lookups_total{result="miss"} 1\n')
    s = aggregate(c, r, Observed(healthy(r), [], usage), T0)
    assert cond(s, "Ready")["status"] == "True"
    assert cond(s, "Progressing")["reason"] == "Stable"
    assert cond(s, "Degraded")["status"] == "False"
    assert cond(s, "KVStoreReady")["message"] == "400 of 4000 bytes used"
    # RDMA not asked for: no RDMAReady noise; KVTransport says what KV really uses
    assert "RDMAReady" not in [c["type"] for c in s["conditions"]] and "rdma" not in s
    assert (cond(s, "KVTransport")["status"], cond(s, "KVTransport")["reason"]) == ("True", "Tcp")
    assert s["kvTransport"] == "tcp"
    assert s["store"] == {"capacityBytes": 4000, "usedBytes": 400, "hitRate": 0.75}
    assert s["roles"]["prefill"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                     "revision": r.revisions["prefill"]}
    assert s["observedGeneration"] == 7
    assert s["endpoint"] == "http://demo-conductor.ml.svc.cluster.local:8000/v1"
    assert all(c["observedGeneration"] == 7 and c["lastTransitionTime"] == T0
               for c in s["conditions"])


def test_rollout_in_progress(base: tuple[Obj, Rendered]) -> None:
    c, r = base
    wl = healthy(r)
    wl["decode"] = workload("decode", 1, 1, updated=0)
    wl["prefill"] = workload("prefill", 2, 2, stale=True)  # controller has not seen the change
    s = aggregate(c, r, Observed(wl, []), T0)
    assert cond(s, "Progressing") == {**cond(s, "Progressing"), "status": "True",
                                      "reason": "RollingOut",
                                      "message": "updating prefill, decode"}
    assert cond(s, "Ready")["reason"] == "RolesNotReady"
    assert "decode 1/1 ready, 0 updated" in cond(s, "Ready")["message"]


def test_missing_store_and_configured_capacity(base: tuple[Obj, Rendered]) -> None:
    c, r = base
    wl = healthy(r)
    wl["store"] = workload("store", 1, 0)
    s = aggregate(c, r, Observed(wl, []), T0)
    assert cond(s, "KVStoreReady")["status"] == "False"
    assert cond(s, "KVStoreReady")["message"] == "master 1/1, store 0/1 ready"
    assert s["store"] == {"capacityBytes": 4 << 30}  # configured DRAM until the master answers


def test_transition_time_only_moves_when_status_changes(base: tuple[Obj, Rendered]) -> None:
    c, r = base
    first = aggregate(c, r, Observed(healthy(r), []), T0)
    c["status"] = first
    same = aggregate(c, r, Observed(healthy(r), []), T1)
    assert same["conditions"] == first["conditions"]
    wl = healthy(r)
    wl["master"] = workload("master", 1, 0)
    changed = aggregate(c, r, Observed(wl, []), T1)
    assert cond(changed, "Ready")["lastTransitionTime"] == T1
    assert cond(changed, "Degraded")["lastTransitionTime"] == T0


def test_crash_looping_pods_degrade(base: tuple[Obj, Rendered]) -> None:
    c, r = base
    pods = [pod("demo-decode-0", "decode", waiting="CrashLoopBackOff")]
    s = aggregate(c, r, Observed(healthy(r), pods), T0)
    assert cond(s, "Degraded") == {**cond(s, "Degraded"), "status": "True",
                                   "reason": "PodsFailing",
                                   "message": "demo-decode-0/decode: CrashLoopBackOff"}


def test_scaled_to_zero_is_not_ready(make_cluster: Callable[..., Obj]) -> None:
    c = validate_cluster(make_cluster())
    r = render(c, {"decode": 0})
    s = aggregate(c, r, Observed(healthy(r), []), T0)
    assert cond(s, "Ready")["reason"] == "ScaledToZero"


USABLE = {"usable": True, "devices": [{"name": "mlx5_0"}], "reason": "1 device(s)"}
NONE = {"usable": False, "devices": [], "reason": "no RDMA device found"}


@pytest.mark.parametrize(("required", "records", "status", "reason"), [
    (False, [USABLE, USABLE, USABLE], "True", "DevicesFound"),
    (False, [USABLE, NONE, USABLE], "False", "NoDevice"),
    (True, [USABLE, NONE, USABLE], "False", "DeviceMissing"),
    (False, [USABLE, None, USABLE], "Unknown", "ProbePending"),
])
def test_rdma_ready_from_probe_records(make_cluster: Callable[..., Obj], required: bool,
                                       records: list[Obj | None], status: str,
                                       reason: str) -> None:
    c = validate_cluster(make_cluster({"rdma": {"enabled": True, "required": required}}))
    r = render(c)
    pods = [pod(f"p{i}", role, rec) if rec is not None else pod(f"p{i}", role)
            for i, (role, rec) in enumerate(zip(("prefill", "decode", "store"), records,
                                                strict=True))]
    pods.append(pod("c", "conductor"))  # not a data pod: ignored
    s = aggregate(c, r, Observed(healthy(r), pods), T0)
    assert (cond(s, "RDMAReady")["status"], cond(s, "RDMAReady")["reason"]) == (status, reason)
    degraded = cond(s, "Degraded")
    assert (degraded["reason"] == "RDMADeviceMissing") is (reason == "DeviceMissing")
    # devices or not, KV moves over TCP, and the conditions say so
    assert (cond(s, "KVTransport")["reason"], s["kvTransport"]) == ("Tcp", "tcp")
    assert "EXPERIMENTAL" in cond(s, "KVTransport")["message"]
    if reason == "DevicesFound":
        assert "mlx5_0" in cond(s, "RDMAReady")["message"]
        assert "over TCP" in cond(s, "RDMAReady")["message"]
    if reason == "NoDevice":
        assert "over TCP" in cond(s, "RDMAReady")["message"]
        assert s["rdma"] == {"podsWithDevices": 2, "podsWithoutDevices": 1,
                             "devices": ["mlx5_0"]}


def test_kv_transport_follows_the_protocol(make_cluster: Callable[..., Obj]) -> None:
    c = validate_cluster(make_cluster({"transferProtocol": "tcp"}))
    r = render(c)
    s = aggregate(c, r, Observed(healthy(r), []), T0)
    assert cond(s, "KVTransport")["message"].startswith("transferProtocol tcp")
    assert s["kvTransport"] == "tcp"
    # the status the operator writes is valid under the CRD's status schema
    validate(cluster_status_schema(ROLES), s)
    # an old RDMAReady from before is dropped once RDMA is not asked for
    c["status"] = {"conditions": [{"type": "RDMAReady", "status": "False",
                                   "reason": "Disabled", "lastTransitionTime": T0}]}
    s = aggregate(c, r, Observed(healthy(r), []), T0)
    assert "RDMAReady" not in [x["type"] for x in s["conditions"]]


# ---- rdma-probe


def _fake_sysfs(root: Path, ports: dict[str, str], uverbs: bool) -> tuple[Path, Path]:
    sys_root, dev_root = root / "sys", root / "dev"
    for dev, state in ports.items():
        port = sys_root / "class" / "infiniband" / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        (port / "link_layer").write_text("Ethernet\n")
    (dev_root / "infiniband").mkdir(parents=True)
    if uverbs:
        (dev_root / "infiniband" / "uverbs0").write_text("")
    return sys_root, dev_root


def test_probe_finds_an_active_device(tmp_path: Path) -> None:
    sys_root, dev_root = _fake_sysfs(tmp_path, {"mlx5_0": "4: ACTIVE", "mlx5_1": "1: DOWN"},
                                     uverbs=True)
    rec = probe(sys_root, dev_root, use_pyverbs=False)
    assert rec["usable"] is True and rec["method"] == "sysfs"
    assert [d["name"] for d in rec["devices"]] == ["mlx5_0", "mlx5_1"]
    assert rec["devices"][0]["ports"] == [{"port": 1, "state": "ACTIVE",
                                           "linkLayer": "Ethernet"}]


@pytest.mark.parametrize(("ports", "uverbs", "why"), [
    ({}, False, "no RDMA device found"),
    ({"mlx5_0": "1: DOWN"}, True, "no port is ACTIVE"),
    ({"mlx5_0": "4: ACTIVE"}, False, "no /dev/infiniband/uverbs*"),
])
def test_probe_explains_why_rdma_is_unusable(tmp_path: Path, ports: dict[str, str],
                                             uverbs: bool, why: str) -> None:
    sys_root, dev_root = _fake_sysfs(tmp_path, ports, uverbs)
    rec = probe(sys_root, dev_root, use_pyverbs=False)
    assert rec["usable"] is False and why in rec["reason"]


def test_probe_cli_on_this_machine_falls_back_and_exits_zero(tmp_path: Path) -> None:
    out, term = tmp_path / "run" / "rdma.json", tmp_path / "termination-log"
    res = CliRunner().invoke(main, ["rdma-probe", "--output", str(out),
                                    "--termination-log", str(term)])
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == json.loads(term.read_text()) == record
    if not record["usable"]:  # the machines this was built on have no RDMA device
        assert "TCP" in record["reason"] or "uverbs" in record["reason"]
        required = CliRunner().invoke(main, ["rdma-probe", "--required",
                                             "--termination-log", str(term)])
        assert required.exit_code == 1


def test_record_fits_the_termination_message(tmp_path: Path) -> None:
    ports = {f"mlx5_{i}": "4: ACTIVE" for i in range(200)}
    sys_root, dev_root = _fake_sysfs(tmp_path, ports, uverbs=True)
    rec = probe(sys_root, dev_root, use_pyverbs=False)
    text = compact(rec)
    assert len(text) <= 4000
    assert json.loads(text)["usable"] is True
