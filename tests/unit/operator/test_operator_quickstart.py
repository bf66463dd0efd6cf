"""The Kubernetes quick start as written in the README and the docs, checked against the charts,
and the Pod Security levels docs/kubernetes.md states, checked against the rendered pods.

No API server runs here. The commands of each quick-start block are replayed in order against
a model of what they change: `kubectl create namespace` adds a namespace, `helm install`
renders the chart (helm-python-sdk, as test_operator_charts.py does) with the values its
`--set`/`-f` give, and every namespaced object it or `kubectl apply -f` creates must land in a
namespace that exists by then (the API server refuses the others). Every value set must exist
in the chart's values.schema.json, and an applied MooncakeCluster must be in a namespace the
operator watches, or nothing would ever reconcile it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[3]
CLUSTER_SCOPED = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "ClusterKopfPeering", "Namespace", "PriorityClass", "StorageClass"}
BUILTIN_KINDS = {"Namespace", "Secret", "ConfigMap", "PersistentVolumeClaim", "Job", "Pod"}


def quickstart_block(text: str, heading: str) -> str:
    """The first ```bash block under the Markdown heading `heading`."""
    section = text.split(f"\n{heading}\n", 1)[1]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, f"no bash block under {heading!r}"
    return m.group(1)


def commands(block: str) -> list[list[str]]:
    """Shell commands of a block: continuation lines joined, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def parse_set(expr: str) -> Obj:
    """Helm's `--set a.b=c,d={x,y}` for the forms a quick start uses (no list indexes)."""
    values: Obj = {}
    for pair in re.split(r",(?![^{]*\})", expr):
        key, sep, raw = pair.partition("=")
        assert sep and key and "[" not in key, f"unsupported --set {pair!r}"
        value: Any
        if raw.startswith("{") and raw.endswith("}"):
            value = [v for v in raw[1:-1].split(",") if v]
        elif raw in ("true", "false"):
            value = raw == "true"
        elif re.fullmatch(r"-?[0-9]+", raw):
            value = int(raw)
        else:
            value = raw
        node = values
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return values


def schema_paths(schema: Obj, values: Obj, prefix: str = "") -> list[str]:
    """Value paths that `schema` does not declare."""
    missing = []
    props = schema.get("properties", {})
    for key, v in values.items():
        path = f"{prefix}{key}"
        if key not in props:
            missing.append(path)
        elif isinstance(v, dict) and props[key].get("type") == "object":
            missing += schema_paths(props[key], v, path + ".")
    return missing


@dataclass
class Cluster:
    """What the quick start has created so far."""

    namespaces: set[str] = field(default_factory=lambda: {"default", "kube-system"})
    kinds: set[str] = field(default_factory=lambda: set(BUILTIN_KINDS))
    watched: list[str] | None = None  # None: no operator; []: every namespace
    errors: list[str] = field(default_factory=list)

    def create(self, objs: list[Obj], default_ns: str, why: str) -> None:
        for o in objs:
            ns = o["metadata"].get("namespace") or default_ns
            if o["kind"] not in CLUSTER_SCOPED and ns not in self.namespaces:
                self.errors.append(f"{why}: {o['kind']} {o['metadata']['name']} needs "
                                   f"namespace {ns}, which does not exist yet")
            if o["kind"] == "CustomResourceDefinition":
                self.kinds.add(o["spec"]["names"]["kind"])


def _option(words: list[str], *names: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w in names]


def _helm_install(c: Cluster, words: list[str], repo: Path) -> None:
    takes_value = ("-n", "--namespace", "--set", "-f", "--values")
    positional = [w for i, w in enumerate(words[2:], 2)
                  if not w.startswith("-") and words[i - 1] not in takes_value]
    release, chart = positional[:2]
    ns = (_option(words, "-n", "--namespace") or ["default"])[0]
    if "--create-namespace" in words:
        c.namespaces.add(ns)
    elif ns not in c.namespaces:
        c.errors.append(f"helm install {release}: namespace {ns} does not exist")
    values: Obj = {}
    for f in _option(words, "-f", "--values"):
        values = _merge(values, yaml.safe_load((repo / f).read_text()) or {})
    for s in _option(words, "--set"):
        values = _merge(values, parse_set(s))
    loaded = helm.Chart.load(repo / chart)
    declared = _declared(repo / chart)
    unknown = schema_paths(declared, values)
    c.errors += [f"helm install {release}: {path} is not in {chart}/values.schema.json"
                 for path in unknown]
    if unknown:
        return  # Helm refuses to render: nothing is installed
    loaded.validate_schema(values)
    out = loaded.render(values, name=release, namespace=ns)
    docs = [d for p, t in sorted(out.items()) if p.endswith(".yaml")
            for d in yaml.safe_load_all(t) if d]
    c.create(docs, ns, f"helm install {release}")
    if chart.rstrip("/").endswith("mooncake-operator"):
        c.watched = list(values.get("watchNamespaces", []))


def _declared(chart: Path) -> Obj:
    """The chart's values schema; for a chart without one, the shape of its values.yaml."""
    if (chart / "values.schema.json").exists():
        schema: Obj = json.loads((chart / "values.schema.json").read_text())
        return schema

    def shape(v: Any) -> Obj:
        if isinstance(v, dict):
            return {"type": "object", "properties": {k: shape(x) for k, x in v.items()}}
        return {}

    return shape(yaml.safe_load((chart / "values.yaml").read_text()) or {})


def _merge(a: Obj, b: Obj) -> Obj:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _kubectl(c: Cluster, words: list[str], repo: Path) -> None:
    ns = _option(words, "-n", "--namespace")
    if ns and ns[0] not in c.namespaces:
        c.errors.append(f"{' '.join(words)}: namespace {ns[0]} does not exist")
    rest = [w for w in words[1:] if w not in ("-n", "--namespace") and w not in ns]
    if rest[:2] == ["create", "namespace"]:
        c.namespaces.add(rest[2])
    elif rest[:1] == ["apply"]:
        for f in _option(words, "-f"):
            docs = [d for d in yaml.safe_load_all((repo / f).read_text()) if d]
            c.create(docs, ns[0] if ns else "default", f"kubectl apply -f {f}")
            for d in docs:
                if d["kind"] not in c.kinds:
                    c.errors.append(f"kubectl apply -f {f}: kind {d['kind']} has no CRD yet")
                where = d["metadata"].get("namespace", "default")
                if d["kind"] == "MooncakeCluster" and (
                        c.watched is None or (c.watched and where not in c.watched)):
                    c.errors.append(f"kubectl apply -f {f}: no operator watches {where}")


def replay(block: str, repo: Path) -> list[str]:
    """The problems the block's commands would run into, in order (empty: it works)."""
    c = Cluster()
    for words in commands(block):
        if words[:2] == ["helm", "install"]:
            _helm_install(c, words, repo)
        elif words[0] == "kubectl":
            _kubectl(c, words, repo)
    return c.errors


QUICK_STARTS = [("README.md", "## Kubernetes"), ("docs/operations.md", "## 3. Kubernetes"),
                ("docs/kubernetes.md", "## Quick start")]


@pytest.mark.parametrize(("doc", "heading"), QUICK_STARTS, ids=[d for d, _ in QUICK_STARTS])
def test_quick_start_commands_work_in_order(doc: str, heading: str) -> None:
    block = quickstart_block((REPO / doc).read_text(), heading)
    words = commands(block)
    assert any(w[:2] == ["helm", "install"] for w in words)
    assert any(w[:2] == ["kubectl", "apply"] for w in words)
    assert replay(block, REPO) == []


def test_the_replay_catches_a_namespace_created_after_the_role() -> None:
    """The order the README had before issue 18: the Role has no namespace to land in."""
    broken = """
helm install mooncake-crds charts/mooncake-crds
helm install mooncake charts/mooncake-operator -n mooncake-system --create-namespace \\
    --set watchNamespaces='{mooncake}'
kubectl create namespace mooncake
kubectl apply -f deploy/examples/laptop-cpu.yaml
"""
    errors = replay(broken, REPO)
    assert errors and all("namespace mooncake, which does not exist" in e for e in errors)
    assert any("Role " in e for e in errors)


@pytest.mark.parametrize(("block", "wanted"), [
    ("kubectl create namespace mooncake\nhelm install m charts/mooncake-operator -n x "
     "--create-namespace --set watchNamespace={mooncake}", "watchNamespace is not in"),
    ("kubectl create namespace mooncake\nhelm install m charts/mooncake-operator -n x "
     "--create-namespace --set monitoring.podmonitor.enabled=true",
     "monitoring.podmonitor is not in"),
    ("kubectl create namespace mooncake\nhelm install m charts/mooncake-operator -n x "
     "--create-namespace --set watchNamespaces={other}\n"
     "helm install c charts/mooncake-crds\n"
     "kubectl apply -f deploy/examples/laptop-cpu.yaml", "no operator watches mooncake"),
    ("kubectl create namespace mooncake\nkubectl apply -f deploy/examples/laptop-cpu.yaml",
     "kind MooncakeCluster has no CRD yet"),
])
def test_the_replay_catches_unknown_values_and_unwatched_clusters(block: str,
                                                                 wanted: str) -> None:
    assert any(wanted in e for e in replay(block, REPO)), replay(block, REPO)


def test_parse_set() -> None:
    assert parse_set("watchNamespaces={a,b},replicaCount=2,verbose=true,image.tag=v1") == {
        "watchNamespaces": ["a", "b"], "replicaCount": 2, "verbose": True,
        "image": {"tag": "v1"}}


# ---- Pod Security Admission levels (docs/kubernetes.md's table)

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def psa_level(pod: Obj) -> str:
    """The strictest Pod Security Standard a pod spec meets, for the fields this operator's
    pods can carry (the checks of the Pod Security Standards that apply to them)."""
    containers = pod.get("initContainers", []) + pod["containers"]
    psc = pod.get("securityContext") or {}
    volumes = [next(k for k in v if k != "name") for v in pod.get("volumes", [])]
    baseline = not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")
                    or "hostPath" in volumes
                    or any((c.get("securityContext") or {}).get("privileged") for c in containers)
                    or any(p.get("hostPort") for c in containers for p in c.get("ports", []))
                    or any(set(((c.get("securityContext") or {}).get("capabilities") or {})
                               .get("add", [])) - BASELINE_CAPS for c in containers))
    if not baseline:
        return "privileged"

    def sc(c: Obj, key: str) -> Any:
        own = (c.get("securityContext") or {}).get(key)
        return own if own is not None else psc.get(key)

    restricted = (set(volumes) <= RESTRICTED_VOLUMES and all(
        (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is False
        and sc(c, "runAsNonRoot") is True and sc(c, "runAsUser") != 0
        and (sc(c, "seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
        and "ALL" in ((c.get("securityContext") or {}).get("capabilities") or {}).get("drop", [])
        and set(((c.get("securityContext") or {}).get("capabilities") or {}).get("add", []))
        <= {"NET_BIND_SERVICE"} for c in containers))
    return "restricted" if restricted else "baseline"


def cluster_level(cluster: Obj) -> str:
    order = ["restricted", "baseline", "privileged"]
    levels = [psa_level(o["spec"]["template"]["spec"])
              for o in render(validate_cluster(cluster)).objects
              if o["kind"] in ("StatefulSet", "Deployment")]
    return max(levels, key=order.index)


def _variant(examples: dict[str, Obj], spec: Obj) -> Obj:
    base = examples["laptop-cpu"]
    return {**base, "spec": _merge(base["spec"], spec)}


VARIANTS: dict[str, Obj] = {
    "rdma.enabled: true": {"rdma": {"enabled": True}, "transferProtocol": "auto"},
    "model.hostPath": {"model": {"hostPath": {"path": "/models/smollm2"}}},
    "model.image": {"model": {"image": {"reference": "registry.example/models:smollm2"}}},
}


def psa_table() -> dict[str, str]:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    section = text.split("\n## Pod Security", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| `(restricted|baseline|privileged)` \|", section, re.M)
    return {key: level for key, level in rows}


def test_pod_security_levels_in_the_docs_are_what_the_pods_need(
        examples: dict[str, Obj]) -> None:
    table = psa_table()
    for name, example in examples.items():
        key = f"`deploy/examples/{name}.yaml`"
        assert key in table, f"docs/kubernetes.md's Pod Security table misses {key}"
        assert table[key] == cluster_level(example), key
    for what, spec in VARIANTS.items():
        key = f"any cluster with `{what}`"
        assert key in table, f"docs/kubernetes.md's Pod Security table misses {key!r}"
        assert table[key] == cluster_level(_variant(examples, spec)), key


def test_psa_level_checker() -> None:
    ok = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
          "containers": [{"name": "a", "securityContext": {
              "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
          "volumes": [{"name": "v", "emptyDir": {}}]}
    assert psa_level(ok) == "restricted"
    assert psa_level({**ok, "securityContext": {"runAsNonRoot": True}}) == "baseline"
    assert psa_level({**ok, "volumes": [{"name": "m", "hostPath": {"path": "/m"}}]}) == \
        "privileged"
    ipc = {**ok, "containers": [{"name": "a", "securityContext": {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}}]}
    assert psa_level(ipc) == "privileged"
