"""SGLang integration parts that need no running server: our page keys are SGLang's (checked
against SGLang's own hash in a subprocess with our CPU import path), the worker's command line
owns the right flags, and the CPU import stand-ins fail loudly when called."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.common.blocks import KeyNamespace, block_keys, sglang_key_prefix
from mooncake_k8s.engine.child import owned_flag
from mooncake_k8s.engine.sglang.server import (
    CPU_PATH,
    OWNED_FLAGS,
    SglangServer,
    SglangServerConfig,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None or bool(
    os.environ.get("MOONCAKE_REQUIRE_SGLANG"))

TENANTS = ["", "tenant-a"]
PAGE_TOKENS = list(range(3000, 3000 + 16 * 5 + 7))


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed")
@pytest.mark.parametrize("tenant", TENANTS)
def test_our_page_keys_are_sglangs_page_hashes(tenant: str,
                                               sglang_probe: dict[str, Any]) -> None:
    ns = KeyNamespace("ab" * 16, "float16", 16, tenant_salt=tenant,
                      kv_layout="sglang/layer_first/tp1")
    theirs = sglang_probe["page_hashes"][TENANTS.index(tenant)]  # SGLang's own hash chain
    ours = block_keys(ns, PAGE_TOKENS)
    assert len(ours) == 5
    assert ours == [sglang_key_prefix(ns) + h for h in theirs]


def test_tenants_and_shapes_never_share_sglang_pages() -> None:
    toks = list(range(64 * 3))
    base = KeyNamespace("cd" * 16, "float16", 64, kv_layout="sglang/layer_first/tp1")
    a = block_keys(KeyNamespace("cd" * 16, "float16", 64, "a", kv_layout=base.kv_layout), toks)
    b = block_keys(KeyNamespace("cd" * 16, "float16", 64, "b", kv_layout=base.kv_layout), toks)
    tp2 = block_keys(KeyNamespace("cd" * 16, "float16", 64, kv_layout="sglang/layer_first/tp2"),
                     toks)
    plain = block_keys(base, toks)
    assert len({*a, *b, *tp2, *plain}) == 12
    # the tenant is in the hash chain, not the prefix: one deployment, one prefix
    assert a[0].rsplit("/", 1)[0] == plain[0].rsplit("/", 1)[0]


def _server(tmp_path: Path, role: str, args: list[str], host: str = "127.0.0.1") -> SglangServer:
    return SglangServer(SglangServerConfig(
        model_dir=tmp_path, served_name="m", fingerprint="ef" * 16, page_tokens=64,
        master="127.0.0.1:1", token="secret-token", role=role, host=host, extra_args=args,
        work_dir=tmp_path))


def test_prefill_command_pairs_hicache_and_pd(tmp_path: Path) -> None:
    s = _server(tmp_path, "prefill", ["--tp-size", "2", "--dtype", "bfloat16"])
    cmd = s.command()
    assert cmd[cmd.index("--disaggregation-mode") + 1] == "prefill"
    assert cmd[cmd.index("--disaggregation-transfer-backend") + 1] == "mooncake"
    extra = json.loads(cmd[cmd.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["interface_v1"] == 1 and extra["class_name"] == "MooncakeK8sHiCache"
    assert extra["key_prefix"] == sglang_key_prefix(s.namespace())
    assert s.kv_layout == "sglang/layer_first/tp2" and s.dtype == "bfloat16"
    assert "--api-key" not in cmd  # loopback: nobody else can reach it
    assert s.bootstrap_addr.startswith("127.0.0.1:")
    env = s.env()
    assert env["MOONCAKE_K8S_SGLANG"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert str(CPU_PATH) in env["PYTHONPATH"].split(os.pathsep)


def test_decode_off_loopback_takes_the_token_as_api_key(tmp_path: Path) -> None:
    s = _server(tmp_path, "decode", [], host="10.1.2.3")
    cmd = s.command()
    assert cmd[cmd.index("--api-key") + 1] == "secret-token"
    assert "--enable-hierarchical-cache" not in cmd and not s.bootstrap_addr
    assert s.headers() == {"Authorization": "Bearer secret-token"}


def test_owned_flags_are_refused(tmp_path: Path) -> None:
    for bad in (["--port", "9"], ["--page-size=16"], ["--disaggregation-mode", "null"],
                ["--hicache-storage-backend", "file"], ["--api-key", "x"]):
        assert owned_flag(bad, OWNED_FLAGS) == bad[0].split("=")[0]
        with pytest.raises(ValueError, match="set by the worker"):
            _server(tmp_path, "prefill", bad)
    assert owned_flag(["--tp-size", "2", "--mem-fraction-static", "0.8"], OWNED_FLAGS) is None


def test_cpu_stand_ins_fail_loudly_when_called() -> None:
    code = ("import sgl_kernel, torchvision\n"
            "from torchvision.transforms import InterpolationMode\n"
            "assert InterpolationMode.BICUBIC.value == 'bicubic'\n"
            "try:\n    sgl_kernel.kvcacheio.transfer_kv_all_layer(1)\n"
            "except NotImplementedError as e:\n    print('loud:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "PYTHONPATH": str(CPU_PATH)}, capture_output=True, text=True,
                         timeout=60, check=True)
    assert "loud: sgl_kernel.kvcacheio.transfer_kv_all_layer is not available" in out.stdout


#: One SGLang process (importing SGLang takes seconds) computes its page hashes and checks the
#: shims and our extend attention: the natives are taken before the shims go in, every field
#: is a finding.
PROBE = """
import json, sys
import torch
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed
toks, page, salts = json.loads(sys.argv[1])
page_hashes = []
for salt in salts:
    prior = storage_namespace_seed(None, salt) if salt else None
    page_hashes.append([])
    for i in range(len(toks) // page):
        prior = get_hash_str(toks[i * page:(i + 1) * page], prior)
        page_hashes[-1].append(prior)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as B
from mooncake_k8s.engine.sglang import cpuattn, cpushims
natives = [Scheduler.on_idle, B._run_sdpa_forward_extend]  # SGLang re-points module names
torch.manual_seed(0)
heads, kv_heads, dim = 9, 3, 64
prefix, new = torch.tensor([0, 70, 128]), torch.tensor([40, 5, 1])
total = prefix + new
slots = torch.randperm(512)[:int(total.sum())]
req_to_token = torch.zeros(3, 256, dtype=torch.int64)
at = 0
for i, n in enumerate(total.tolist()):
    req_to_token[i, :n] = slots[at:at + n]
    at += n
k_cache, v_cache = torch.randn(512, kv_heads, dim), torch.randn(512, kv_heads, dim)
q = torch.randn(int(new.sum()), heads, dim)
args = (q, k_cache, v_cache, req_to_token, torch.arange(3), total, prefix, new)
want = natives[1](None, q, torch.empty_like(q), *args[1:], scaling=0.125, enable_gqa=True,
                  causal=True)
got = cpuattn.extend(natives[1], None, q, torch.empty_like(q), *args[1:], scaling=0.125,
                     enable_gqa=True, causal=True)
missing = cpushims.check()
cpushims.apply()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
import sglang.srt.mem_cache.pool_host.base as b
print(json.dumps({
    "page_hashes": page_hashes,
    "attn_close": bool(torch.allclose(got, want, atol=1e-5, rtol=1e-5)),
    "attn_max_err": float((got - want).abs().max()),
    "missing": missing,
    "nap_installed": getattr(Scheduler.on_idle, "__wrapped__", None) is natives[0],
    "extend_installed": getattr(B._run_sdpa_forward_extend, "__wrapped__", None) is natives[1],
    "reserve": b.HICACHE_HOST_MEMORY_RESERVE_BYTES,
}))
"""


@pytest.fixture(scope="module")
def sglang_probe() -> dict[str, Any]:
    from mooncake_k8s.common.blocks import engine_cache_salt

    salts = [engine_cache_salt(t) for t in TENANTS]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([PAGE_TOKENS, 16, salts])], env={
        **os.environ, "PYTHONPATH": str(CPU_PATH), "SGLANG_USE_CPU_ENGINE": "1",
        "MOONCAKE_SGLANG_HOST_RESERVE_MIB": "300"}, capture_output=True, text=True,
        timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    found: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return found


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed")
def test_cpu_shims_find_what_they_replace_and_relax_the_host_reserve(
        sglang_probe: dict[str, Any]) -> None:
    """Against the installed SGLang: every symbol the shims touch exists (an upgrade that moves
    one fails here and at SGLang's start, not at the first request), the host-pool reserve
    follows MOONCAKE_SGLANG_HOST_RESERVE_MIB, and the scheduler's wait loop naps."""
    assert sglang_probe["missing"] == []
    assert sglang_probe["nap_installed"] is True, "the wait-poll nap is missing"
    assert sglang_probe["reserve"] == 300 << 20


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed")
def test_cpu_extend_attention_equals_sglangs_from_the_new_tokens_alone(
        sglang_probe: dict[str, Any]) -> None:
    """Our extend attention (a prefix hit attends from its new tokens only, issue 20) gives
    SGLang's output for requests with and without a cached prefix, GQA heads included, and the
    shims install it."""
    assert sglang_probe["attn_close"] is True, sglang_probe["attn_max_err"]
    assert sglang_probe["extend_installed"] is True, "the extend attention is not ours"
