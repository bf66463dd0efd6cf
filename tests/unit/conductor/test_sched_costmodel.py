"""Cost model: shipped profiles, files, validation, and the fits calibration relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_k8s.conductor.sched import costmodel
from mooncake_k8s.conductor.sched.costmodel import CostModelError


def test_default_profile_loads_and_is_physical() -> None:
    m = costmodel.load()
    assert m.name == costmodel.DEFAULT_PROFILE
    assert "llama3-70b-a800x8" in costmodel.profiles()
    assert m.kv_bytes_per_token == 80 * 2 * 1024 * 2  # layers x K,V x kv dims x bf16
    # Longer prompts cost more; a cached prefix saves most but not all of it.
    assert m.prefill_ms(8192) > m.prefill_ms(4096) > 0
    assert m.prefill_ms(4096) > m.prefill_ms(4096, 4096) / 2
    assert m.prefill_ms(1, 8191) < m.prefill_ms(8192)
    assert m.transfer_ms("pool", 1000) > m.transfer_ms("local", 1000)
    assert m.step_ms(64, 500_000) > m.step_ms(1, 1000) > 0
    assert m.prefill_ms(0) == 0 and m.step_ms(0, 0) == 0


def test_unknown_path_falls_back_to_pool() -> None:
    m = costmodel.load()
    assert m.link("nvlink") == m.transfer["pool"]


def test_kv_on_another_host_never_loads_faster_than_kv_on_this_one() -> None:
    import dataclasses

    cpu = costmodel.load(costmodel.BUILTIN_CPU_PROFILE)
    here = cpu.transfer_ms("local", 1000)
    slow = dataclasses.replace(cpu, transfer={**cpu.transfer,
                                              "pool": costmodel.Link(0.5, 0.0125)})
    assert slow.remote_ms(1000) == slow.transfer_ms("pool", 1000) > here  # 100 Mbit/s
    fast = dataclasses.replace(cpu, transfer={**cpu.transfer,
                                              "pool": costmodel.Link(0.5, 1.25)})
    assert fast.transfer_ms("pool", 1000) < here  # 10 Gbit/s beats the CPU's load...
    assert fast.remote_ms(1000) == pytest.approx(here + 0.5)  # ...which still bounds it
    assert fast.remote_ms(0) == 0


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_and_load_round_trip(tmp_path: Path, suffix: str) -> None:
    m = costmodel.load()
    path = tmp_path / f"model{suffix}"
    m.save(path)
    again = costmodel.load(path)
    assert again.to_dict() == m.to_dict()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("kv_bytes_per_token"), "malformed"),
    (lambda d: d["prefill"].__setitem__("per_token_ms", -1), "prefill.per_token_ms"),
    (lambda d: d["transfer"].__setitem__("warp", {"latency_ms": 0, "gbps": 1}), "unknown"),
    (lambda d: d["transfer"]["pool"].__setitem__("gbps", 0), "gbps"),
    (lambda d: d["transfer"].pop("pool"), "transfer.pool"),
])
def test_bad_profiles_are_refused_with_a_reason(tmp_path: Path, mutate, message) -> None:  # type: ignore[no-untyped-def]
    d = costmodel.load().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=message):
        costmodel.load(path)


def test_missing_profile_names_the_shipped_ones() -> None:
    with pytest.raises(CostModelError, match="llama3-70b-a800x8"):
        costmodel.load("no-such-profile")


def test_prefill_fit_recovers_known_coefficients_and_load_cost() -> None:
    base, per_tok, attn, load = 5.0, 0.02, 1e-5, 0.004
    samples = []
    for new in (64, 128, 256, 512, 1024, 2048):
        for cached in (0, 256, 1024):
            ms = base + per_tok * new + attn * new * (cached + new / 2) + load * cached
            samples.append((new, cached, ms))
    pf, load_fit, fit = costmodel.fit_prefill(samples)
    assert pf.base_ms == pytest.approx(base, rel=1e-6)
    assert pf.per_token_ms == pytest.approx(per_tok, rel=1e-6)
    assert pf.attn_ms == pytest.approx(attn, rel=1e-6)
    assert load_fit == pytest.approx(load, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_fit_never_returns_negative_coefficients() -> None:
    # Decode steps that do not depend on context at all, plus noise that would push the
    # context coefficient below zero in an unconstrained fit.
    samples = [(b, c, 10 + 0.5 * b - (0.001 if c > 5000 else 0)) for b in (1, 2, 4, 8)
               for c in (100, 10_000)]
    dec, _ = costmodel.fit_decode(samples)
    assert dec.per_ctx_token_ms == 0.0
    assert dec.per_seq_ms == pytest.approx(0.5, rel=0.01)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(CostModelError, match="at least"):
        costmodel.fit_decode([(1, 10, 1.0)])


def test_cuda_visible_is_read_without_torch_and_honours_cuda_visible_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default profile's device question is answered from the host's device nodes (no
    torch import in a Conductor); CUDA_VISIBLE_DEVICES that hides every device means no CUDA."""
    nodes = any(Path("/dev").glob("nvidia[0-9]*"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert costmodel.cuda_visible() is nodes
    for hidden in ("", "-1", " "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert costmodel.cuda_visible() is False
        assert costmodel.default_profile(None, None) == costmodel.BUILTIN_CPU_PROFILE
    code = ("import sys; from mooncake_k8s.conductor.sched import costmodel; "
            "costmodel.default_profile(None, None); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
