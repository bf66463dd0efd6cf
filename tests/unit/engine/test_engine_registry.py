"""The engine seam: kinds found by name without importing their engines, each kind's settings
its own, and the seam's module depending on nothing but `common` (no model, no store)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.adapter import ChildSettings
from mooncake_k8s.engine.api import EngineKind, EngineSettings, ModelConfig
from mooncake_k8s.engine.registry import ENGINE_KINDS, UnknownEngineKind, engine_kind
from mooncake_k8s.engine.sglang.kind import SglangSettings

SERVICES = Path(__file__).resolve().parents[3] / "services"


def test_every_kind_resolves_to_its_engine_kind() -> None:
    assert ENGINE_KINDS == ("embedded", "vllm", "sglang")
    for name in ENGINE_KINDS:
        kind = engine_kind(name)
        assert issubclass(kind, EngineKind) and kind.name == name
        assert isinstance(kind.settings({}), kind.settings_type)
    assert not engine_kind("embedded").takes_args
    assert engine_kind("vllm").takes_args and "--kv-transfer-config" in engine_kind(
        "vllm").owned_flags
    assert "--disaggregation-mode" in engine_kind("sglang").owned_flags


def test_an_unknown_kind_is_named_in_the_error() -> None:
    with pytest.raises(UnknownEngineKind, match=r"unknown engine kind 'tgi'; known: embedded, "
                                                r"vllm, sglang"):
        engine_kind("tgi")
    assert issubclass(UnknownEngineKind, InvalidArgument)


def test_looking_up_a_kind_imports_neither_its_server_nor_torch() -> None:
    """The CLI asks a kind what is missing before anything else: that must work where the
    kind's package is not installed, and cost nothing where it is."""
    code = ("import sys\n"
            "from mooncake_k8s.engine.registry import ENGINE_KINDS, engine_kind\n"
            "for k in ENGINE_KINDS:\n"
            "    engine_kind(k).missing()\n"
            "print(sorted(m for m in ('vllm', 'sglang', 'torch', 'transformers') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_each_kind_takes_its_own_settings_from_the_options() -> None:
    options: dict[str, object] = {"args": ("--enforce-eager",), "ready_timeout_s": 30.0,
                                  "pd_port": 7300, "bootstrap_port": 8998, "sidecar": "/s.sock",
                                  "not_a_setting": 1}
    assert engine_kind("embedded").settings(options) == EngineSettings()
    assert engine_kind("vllm").settings(options) == ChildSettings(("--enforce-eager",), 30.0)
    assert engine_kind("sglang").settings(options) == SglangSettings(
        ("--enforce-eager",), 30.0, bootstrap_port=8998, pd_port=7300, sidecar="/s.sock")


def test_the_embedded_kind_keeps_its_own_config_and_fills_a_plain_model_in() -> None:
    from mooncake_k8s.engine.embedded import EngineConfig
    from mooncake_k8s.engine.embedded.kind import engine_config

    own = EngineConfig(max_batch=3, threads=2)
    assert engine_config(own) is own
    got = engine_config(ModelConfig(model="/m", served_name="n", device="cpu", block_tokens=16))
    assert got == EngineConfig(model="/m", served_name="n", device="cpu", block_tokens=16)


def test_model_config_checks_what_every_kind_shares() -> None:
    with pytest.raises(InvalidArgument, match="block_tokens must be >= 1"):
        ModelConfig(block_tokens=0)
    with pytest.raises(InvalidArgument, match="device must be"):
        ModelConfig(device="tpu")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_seam_imports_only_common_and_the_standard_library() -> None:
    deps = _imports(SERVICES / "engine" / "api.py")
    ours = {d for d in deps if d.startswith(("mooncake_k8s", "."))}
    assert ours and all(d.startswith("mooncake_k8s.common") for d in ours), ours
    third_party = {d.split(".")[0] for d in deps - ours} - set(sys.stdlib_module_names)
    assert third_party == set()


def test_the_worker_sees_the_engine_only_through_the_seam_and_the_registry() -> None:
    engine_deps = {d for p in (SERVICES / "worker").rglob("*.py") for d in _imports(p)
                   if d.startswith("mooncake_k8s.engine")}
    assert engine_deps == {"mooncake_k8s.engine.api", "mooncake_k8s.engine.registry"}
    back = {(str(p.relative_to(SERVICES)), d) for p in (SERVICES / "engine").rglob("*.py")
            for d in _imports(p) if d.startswith("mooncake_k8s.worker")}
    assert back == set()
