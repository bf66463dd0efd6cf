"""store.fanout: the CR's switch for hot-object fan-out, rendered into the master's
environment, which the master's own flags read back (off unless asked for)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mooncake_k8s.cli.main import store_master
from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

Obj = dict[str, Any]


def master_env(make_cluster: Callable[..., Obj], store: Obj) -> dict[str, str]:
    r = render(validate_cluster(make_cluster({"store": store})))
    pod = r.get("StatefulSet", naming.name("demo", "master"))["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "master"]
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def master_params(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `mooncake store master` parses from that environment (nothing is started)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = store_master.make_context("master", [])
    return dict(ctx.params)


def test_fanout_is_off_unless_enabled(make_cluster: Callable[..., Obj],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = master_env(make_cluster, {})
    assert not any(k.startswith("MOONCAKE_FANOUT") for k in env)
    assert master_params(env, monkeypatch)["fanout"] is False


def test_fanout_settings_reach_the_master_as_it_reads_them(
        make_cluster: Callable[..., Obj], monkeypatch: pytest.MonkeyPatch) -> None:
    env = master_env(make_cluster, {"fanout": {"enabled": True, "threshold": 3,
                                               "windowSeconds": 2.5, "maxReplicas": 6}})
    got = master_params(env, monkeypatch)
    assert (got["fanout"], got["fanout_threshold"], got["fanout_window_s"],
            got["fanout_max_replicas"]) == (True, 3, 2.5, 6)


@pytest.mark.parametrize(("fanout", "where"), [
    ({"enabled": True, "threshold": 0}, "spec.store.fanout.threshold"),
    ({"enabled": True, "maxReplicas": 1}, "spec.store.fanout.maxReplicas"),
    ({"enabled": True, "windowSeconds": 0}, "spec.store.fanout.windowSeconds"),
    ({"enabled": "yes"}, "spec.store.fanout.enabled"),
])
def test_bad_fanout_is_refused_naming_the_field(make_cluster: Callable[..., Obj],
                                                fanout: Obj, where: str) -> None:
    with pytest.raises(InvalidResource) as info:
        validate_cluster(make_cluster({"store": {"fanout": fanout}}))
    assert any(where in e for e in info.value.errors), info.value.errors
