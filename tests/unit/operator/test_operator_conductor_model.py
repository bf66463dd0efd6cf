"""The Conductor's pod gets the cluster's model (issue 18): the same tokenizer as the workers.

Before, the Conductor's Deployment had no MOONCAKE_MODEL, no served name and no model volume,
so it tokenised with the built-in SmolLM2 while the workers served another model. Here a small
local Hugging Face directory with its own tokenizer (trained in the test, so it is not SmolLM2's)
is the cluster's hostPath model; the rendered Conductor's MOONCAKE_MODEL is followed through its
volume mounts back to that directory and loaded as the Conductor loads it, and its tokenizer
fingerprint must equal the one the workers' rendered path yields, and differ from the built-in's.
The Hugging Face source is checked for the tokenizer-only download, and every example for the
model, served name and the shutdown and metrics settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from mooncake_k8s.common import defaults
from mooncake_k8s.common.tokenizer_id import tokenizer_fingerprint
from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import Rendered, render
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
K8S_VERSION = "1.33"
_CORPUS = ["the quick brown fox jumps over the lazy dog", "mooncake serves a cluster's model",
           "prefill and decode share one tokenizer", "zebras quietly vex jumpy wizards"] * 20


def make_tokenizer_dir(path: Path) -> Path:
    """A Hugging Face directory with a config.json and a BPE tokenizer trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"
    path.mkdir(parents=True)
    fast.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    return path


def _template(r: Rendered, role: str, cluster: str = "demo") -> Obj:
    kind = "Deployment" if role == "conductor" else "StatefulSet"
    t: Obj = r.get(kind, naming.name(cluster, role))["spec"]["template"]
    return t


def _main(t: Obj) -> Obj:
    c: Obj = t["spec"]["containers"][0]
    return c


def _values(c: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def _host_dir(t: Obj, container_path: str) -> Path:
    """Where a path inside the main container lies on the node (through hostPath volumes)."""
    volumes = {v["name"]: v for v in t["spec"]["volumes"]}
    for m in _main(t)["volumeMounts"]:
        root = m["mountPath"]
        if container_path == root or container_path.startswith(root + "/"):
            host = volumes[m["name"]]["hostPath"]["path"]
            return Path(host + container_path[len(root):])
    raise AssertionError(f"{container_path} is not on a mounted volume")


def _load_fingerprint(model_dir: str | None) -> str:
    """The tokenizer the Conductor loads for MOONCAKE_MODEL, fingerprinted."""
    from mooncake_k8s.conductor.service import load_tokenizer
    from mooncake_k8s.engine import EngineConfig

    return tokenizer_fingerprint(load_tokenizer(EngineConfig(model=model_dir)))


def test_conductor_gets_a_local_model_with_its_own_tokenizer(
        tmp_path: Path, make_cluster: Callable[..., Obj]) -> None:
    model = make_tokenizer_dir(tmp_path / "tiny-model")
    r = render(validate_cluster(make_cluster({"model": {"hostPath": {"path": str(model)},
                                                        "servedName": "tiny"}})))
    cond, worker = _template(r, "conductor"), _template(r, "prefill")
    cenv, wenv = _values(_main(cond)), _values(_main(worker))
    assert cenv["MOONCAKE_MODEL"] == wenv["MOONCAKE_MODEL"] == "/models"
    assert cenv["MOONCAKE_SERVED_MODEL_NAME"] == wenv["MOONCAKE_SERVED_MODEL_NAME"] == "tiny"
    assert _host_dir(cond, cenv["MOONCAKE_MODEL"]) == model == _host_dir(
        worker, wenv["MOONCAKE_MODEL"])
    mount = next(m for m in _main(cond)["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    ours = _load_fingerprint(str(_host_dir(cond, cenv["MOONCAKE_MODEL"])))
    from mooncake_k8s.engine.loading import dir_tokenizer_fingerprint

    assert ours == dir_tokenizer_fingerprint(_host_dir(worker, wenv["MOONCAKE_MODEL"]))
    assert ours != _load_fingerprint(None), "the test model's tokenizer must not be SmolLM2's"
    kubernetes_validate.validate(r.get("Deployment", "demo-conductor"), K8S_VERSION, strict=True)


@pytest.mark.parametrize("claim", [None, "model-cache"])
def test_conductor_downloads_only_the_tokenizer_of_a_hub_model(
        make_cluster: Callable[..., Obj], claim: str | None) -> None:
    hf: Obj = {"id": "Qwen/Qwen2.5-7B-Instruct", "revision": "abc123",
               "tokenSecret": {"name": "hf", "key": "token"}}
    if claim:  # the workers share a download claim; the Conductor never mounts or waits on it
        hf["cacheClaimName"] = claim
    r = render(validate_cluster(make_cluster({"model": {"huggingFace": hf}})))
    cond, worker = _template(r, "conductor"), _template(r, "decode")
    init = {c["name"]: c for c in cond["spec"]["initContainers"]}
    assert list(init) == ["tokenizer-download"]
    cmd = init["tokenizer-download"]["command"]
    # The workers' id and revision, only tokenizer and config files, into the model volume.
    wcmd = {c["name"]: c for c in worker["spec"]["initContainers"]}["model-download"]["command"]
    assert cmd[3:5] == wcmd[3:5] == ["Qwen/Qwen2.5-7B-Instruct", "abc123"]
    assert cmd[5] == _values(_main(cond))["MOONCAKE_MODEL"] == "/models/hf"
    assert set(cmd[6:]) == {"*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"}
    assert not any(p.endswith((".safetensors", ".bin", ".pt", ".gguf")) or p == "*"
                   for p in cmd[6:])
    env = {e["name"]: e for e in init["tokenizer-download"]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    vol = {v["name"]: v for v in cond["spec"]["volumes"]}["model"]
    assert vol == {"name": "model", "emptyDir": {"sizeLimit": "256Mi"}}
    assert _values(_main(cond))["MOONCAKE_SERVED_MODEL_NAME"] == "Qwen/Qwen2.5-7B-Instruct"
    kubernetes_validate.validate(r.get("Deployment", "demo-conductor"), K8S_VERSION, strict=True)


@pytest.mark.parametrize("grace", [None, 15, 600])
def test_conductor_shutdown_and_metrics_port(make_cluster: Callable[..., Obj],
                                             grace: int | None) -> None:
    spec: Obj = {"roles": {"conductor": {"terminationGracePeriodSeconds": grace}}} if grace \
        else {}
    t = _template(render(validate_cluster(make_cluster(spec))), "conductor")
    c = _main(t)
    want = grace or defaults.CONDUCTOR_GRACE_S
    assert t["spec"]["terminationGracePeriodSeconds"] == want
    assert c["lifecycle"] == {"preStop": {"exec": {"command": [
        "sleep", str(defaults.CONDUCTOR_PRESTOP_S)]}}}
    # The drain ends before the kubelet's SIGKILL: grace = preStop + drain + margin.
    drain = int(_values(c)["MOONCAKE_SHUTDOWN_TIMEOUT"])
    assert 0 < drain < want - defaults.CONDUCTOR_PRESTOP_S
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": defaults.CONDUCTOR_PORT, "metrics": defaults.CONDUCTOR_METRICS_PORT}
    assert _values(c)["MOONCAKE_CONDUCTOR_METRICS_PORT"] == str(defaults.CONDUCTOR_METRICS_PORT)
    assert _values(c)["MOONCAKE_CONDUCTOR_METRICS_HOST"] == "$(MOONCAKE_POD_IP)"
    assert "MOONCAKE_METRICS_ON_API_PORT" not in _values(c)
    assert naming.METRICS_PORT["conductor"] == "metrics"  # what the operator scrapes
    # Liveness stays answered through a drain (the API listener closes on SIGTERM).
    assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_every_example_gives_the_conductor_the_workers_model(
        examples: dict[str, Obj]) -> None:
    for stem, doc in examples.items():
        r, name = render(validate_cluster(doc)), doc["metadata"]["name"]
        cond, worker = _template(r, "conductor", name), _template(r, "prefill", name)
        cenv, wenv = _values(_main(cond)), _values(_main(worker))
        assert cenv["MOONCAKE_SERVED_MODEL_NAME"] == wenv["MOONCAKE_SERVED_MODEL_NAME"], stem
        model = doc["spec"].get("model", {})
        if "huggingFace" in model:  # the same id and revision, tokenizer files only
            cinit = {c["name"]: c for c in cond["spec"]["initContainers"]}
            winit = {c["name"]: c for c in worker["spec"]["initContainers"]}
            assert (cinit["tokenizer-download"]["command"][3:5]
                    == winit["model-download"]["command"][3:5]), stem
            assert cenv["MOONCAKE_MODEL"] == cinit["tokenizer-download"]["command"][5], stem
        else:  # the same mounted source at the same path, or the built-in model ("")
            assert cenv["MOONCAKE_MODEL"] == wenv["MOONCAKE_MODEL"], stem
        if any(k in model for k in ("pvc", "hostPath", "image")):
            cvol = {v["name"]: v for v in cond["spec"]["volumes"]}["model"]
            wvol = {v["name"]: v for v in worker["spec"]["volumes"]}["model"]
            assert cvol == wvol, stem
