"""model.huggingFace.p2p (issue 22 item 2): the model download shares through the P2P store.

Rendered: off by default (the classic download, unchanged); on, the download container gets the
P2P script, the store master's address and the cluster token; with a shared cache claim it is
refused with a message naming the field. What the script does against a real store is
tests/integration/store/test_p2p_model_download.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mooncake_k8s.operator import naming
from mooncake_k8s.operator.pods_volumes import _DOWNLOAD, _DOWNLOAD_P2P, p2p_model_name
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

Obj = dict[str, Any]


def pod(make_cluster: Callable[..., Obj], hf: Obj, role: str) -> Obj:
    r = render(validate_cluster(make_cluster({"model": {"huggingFace": hf}})))
    spec: Obj = r.get("StatefulSet", naming.name("demo", role))["spec"]["template"]["spec"]
    return spec


def download(make_cluster: Callable[..., Obj], hf: Obj, role: str = "decode") -> Obj:
    spec = pod(make_cluster, hf, role)
    init: Obj = next(c for c in spec["initContainers"] if c["name"] == "model-download")
    return init


def test_off_by_default_the_download_is_the_classic_one(
        make_cluster: Callable[..., Obj]) -> None:
    init = download(make_cluster, {"id": "org/m"})
    assert init["command"][2] == _DOWNLOAD and len(init["command"]) == 6
    assert "MOONCAKE_MASTER" not in {e["name"] for e in init["env"]}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_p2p_renders_the_peer_fetch_with_master_and_token(
        make_cluster: Callable[..., Obj], role: str) -> None:
    hf = {"id": "org/m", "revision": "v1.2", "p2p": True}
    init = download(make_cluster, hf, role)
    assert init["command"][:3] == ["python", "-c", _DOWNLOAD_P2P]
    assert init["command"][3:] == ["org/m", "v1.2", "/models/hf", "hf/org/m/v1.2"]
    env = {e["name"]: e for e in init["env"]}
    # the store master the engine itself uses
    main_env = {e["name"]: e for e in pod(make_cluster, hf, role)["containers"][0]["env"]}
    assert env["MOONCAKE_MASTER"] == main_env["MOONCAKE_MASTER"]
    assert env["MOONCAKE_MASTER"]["value"].startswith("demo-master.ml.svc")
    assert env["MOONCAKE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
        "demo-cluster-token"


def test_p2p_names_are_valid_store_names() -> None:
    from mooncake_k8s.store.p2p.manifest import check_name

    for rev in ("main", "refs/pr/1", "v1+local", "0123abcd" * 5):
        assert check_name(p2p_model_name("Qwen/Qwen3-0.6B", rev)).startswith("hf/Qwen/")


def test_p2p_with_a_shared_cache_claim_is_refused(make_cluster: Callable[..., Obj]) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_cluster(make_cluster({"model": {"huggingFace": {
            "id": "org/m", "p2p": True, "cacheClaimName": "models"}}}))
    assert any("spec.model.huggingFace.p2p" in m and "cacheClaimName" in m
               for m in err.value.errors), err.value.errors
