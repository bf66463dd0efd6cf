"""Prefill pods serve pool memory on their node, as decode pods do (issue 20 item 2).

`roles.prefill.localSegmentSize` reaches the worker as MOONCAKE_LOCAL_SEGMENT_SIZE, and the
memory it takes is in the pod's Memory-backed /dev/shm (on top of the transfer buffers of
`shmSize`) and in the container's memory requests and limits, which Kubernetes charges the
emptyDir to; a limit that cannot hold it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import Rendered, SpecError, render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

Obj = dict[str, Any]
GI, MI = 1 << 30, 1 << 20


def _prefill(make_cluster: Callable[..., Obj], **prefill: Any) -> tuple[Rendered, Obj]:
    r = render(validate_cluster(make_cluster({"roles": {"prefill": prefill}})))
    sts = r.get("StatefulSet", "demo-prefill")
    kubernetes_validate.validate(sts, "1.33", True)
    c: Obj = next(c for c in sts["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "prefill")
    return r, c


def _shm(r: Rendered) -> Obj:
    vols = r.get("StatefulSet", "demo-prefill")["spec"]["template"]["spec"]["volumes"]
    v: Obj = next(v for v in vols if v["name"] == "dshm")
    return v


def _env(c: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def test_a_prefill_pod_serves_a_segment_by_default(make_cluster: Callable[..., Obj]) -> None:
    spec = validate_cluster(make_cluster({}))["spec"]
    assert spec["roles"]["prefill"]["localSegmentSize"] == "1Gi"
    r, c = _prefill(make_cluster)
    assert _env(c)["MOONCAKE_LOCAL_SEGMENT_SIZE"] == str(GI)
    # /dev/shm: shmSize's 1Gi of transfer buffers plus the 1Gi segment, in memory
    assert _shm(r) == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # the default requests and limits sit on top of it (1Gi and 2Gi for the process)
    assert c["resources"]["requests"]["memory"] == "3Gi"
    assert c["resources"]["limits"]["memory"] == "4Gi"


def test_the_segment_size_sizes_the_pod(make_cluster: Callable[..., Obj]) -> None:
    r, c = _prefill(make_cluster, localSegmentSize="6Gi", shmSize="512Mi")
    assert _env(c)["MOONCAKE_LOCAL_SEGMENT_SIZE"] == str(6 * GI)
    assert _shm(r)["emptyDir"]["sizeLimit"] == naming.format_bytes(6 * GI + 512 * MI)
    assert c["resources"]["requests"]["memory"] == naming.format_bytes(7 * GI + 512 * MI)
    r, c = _prefill(make_cluster, localSegmentSize=0)  # none: transfer buffers only
    assert _env(c)["MOONCAKE_LOCAL_SEGMENT_SIZE"] == "0"
    assert _shm(r)["emptyDir"]["sizeLimit"] == "1Gi"
    decode = r.get("StatefulSet", "demo-decode")["spec"]["template"]["spec"]["containers"][0]
    assert _env(decode)["MOONCAKE_LOCAL_SEGMENT_SIZE"] == str(2 * GI)  # decode's own field


def test_a_memory_limit_that_cannot_hold_the_segment_is_refused(
        make_cluster: Callable[..., Obj]) -> None:
    limits = {"limits": {"memory": "3Gi"}}
    _, c = _prefill(make_cluster, resources=limits)  # 2Gi of /dev/shm fits a 3Gi limit
    assert c["resources"]["limits"]["memory"] == "3Gi"
    with pytest.raises(SpecError, match=r"roles\.prefill\.resources\.limits\.memory \(3Gi\) is "
                                        r"below the role's Memory-backed /dev/shm \(5Gi\)"):
        _prefill(make_cluster, resources=limits, localSegmentSize="4Gi")


@pytest.mark.parametrize("bad", ["512Ki", 1000, "lots", -1])
def test_a_bad_segment_size_is_refused_by_name(make_cluster: Callable[..., Obj],
                                               bad: Any) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_cluster(make_cluster({"roles": {"prefill": {"localSegmentSize": bad}}}))
    assert any(e.startswith("spec.roles.prefill.localSegmentSize") for e in err.value.errors), (
        err.value.errors)
