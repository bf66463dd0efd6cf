"""CLI argument parsing that needs no running servers."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.cli.options import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("2G", 2 * 10**9),
     ("1.5KiB", 1536), ("64kib", 65536), ("10 MB", 10**7)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "12 parsecs", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_bad_size_flag_is_a_usage_error() -> None:
    r = CliRunner().invoke(main, ["store", "node", "--dram-size", "lots"])
    assert r.exit_code == 2 and "not a size" in r.output


@pytest.mark.parametrize(("args", "fragment"), [
    (["--max-body-size", "0"], "too small"),
    (["--max-body-size", "lots"], "not a size"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--idle-timeout", "-1"], "--idle-timeout"),
])
def test_conductor_edge_limits_are_validated(args: list[str], fragment: str) -> None:
    r = CliRunner().invoke(main, ["conductor", "--prefill", "p:1", "--decode", "d:1", *args])
    assert r.exit_code == 2 and fragment in r.output, r.output


def test_node_rejects_ssd_size_without_dir() -> None:
    r = CliRunner().invoke(main, ["store", "node", "--ssd-size", "1GiB"])
    assert r.exit_code == 2 and "--ssd-dir" in r.output


def test_master_rejects_inverted_watermarks() -> None:
    r = CliRunner().invoke(
        main, ["store", "master", "--high-watermark", "0.5", "--low-watermark", "0.9"]
    )
    assert r.exit_code == 2 and "below --high-watermark" in r.output


def test_embedded_engine_refuses_pass_through_arguments() -> None:
    r = CliRunner().invoke(main, ["prefill", "--", "--max-model-len", "4096"])
    assert r.exit_code == 2 and "embedded engine takes no pass-through" in r.output


def test_engine_args_come_from_env_flags_and_after_dashes(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from mooncake_k8s.cli.serving import engine_args

    monkeypatch.setenv("MOONCAKE_ENGINE_ARGS", "--dtype bfloat16 --served-model-name 'a b'")
    got = engine_args({"engine_args": ("--enforce-eager",), "engine_argv": ("--seed", "3")})
    assert got == ["--dtype", "bfloat16", "--served-model-name", "a b", "--enforce-eager",
                   "--seed", "3"]
    monkeypatch.setenv("MOONCAKE_ENGINE_ARGS", "--dtype 'unclosed")
    r = CliRunner().invoke(main, ["prefill"])
    assert r.exit_code == 2 and "MOONCAKE_ENGINE_ARGS" in r.output


def test_vllm_flags_the_worker_owns_are_refused() -> None:
    from mooncake_k8s.engine.child import owned_flag
    from mooncake_k8s.engine.vllm.server import OWNED_FLAGS

    assert owned_flag(["--dtype", "bfloat16", "--port=9"], OWNED_FLAGS) == "--port"
    assert owned_flag(["--kv-transfer-config", "{}"], OWNED_FLAGS) == "--kv-transfer-config"
    assert owned_flag(["--enforce-eager", "--max-model-len", "2048"], OWNED_FLAGS) is None


def test_up_gives_engines_cpu_defaults_only_when_the_user_gave_none(tmp_path: object) -> None:
    """`mooncake up --engine sglang|vllm` on a CPU box adds the flags that make the engine
    usable there; any engine argument the user passes replaces them whole."""
    import torch

    from mooncake_k8s.up import SGLANG_CPU_DEFAULTS, VLLM_CPU_DEFAULTS, LocalCluster, UpConfig

    if torch.cuda.is_available():
        pytest.skip("the CPU defaults apply only without a GPU")

    def args(**kw: object) -> list[str]:
        return LocalCluster(UpConfig(log_dir=str(tmp_path), **kw))._engine_args()  # type: ignore[arg-type]

    assert args(engine="embedded") == []
    assert args(engine="sglang") == ["--engine", "sglang",
                                     *(f"--engine-arg={a}" for a in SGLANG_CPU_DEFAULTS)]
    assert "--engine-arg=--dtype" in args(engine="vllm")
    assert len(args(engine="vllm")) == 2 + len(VLLM_CPU_DEFAULTS)
    assert args(engine="sglang", engine_args=("--dtype", "bfloat16")) == [
        "--engine", "sglang", "--engine-arg=--dtype", "--engine-arg=bfloat16"]


def test_rdma_transfer_protocol_is_refused_with_the_reason() -> None:
    """Asking for RDMA where no device and pyverbs exist fails at start with detect_rdma's
    reason, not silently on TCP (no machine running this suite has an RDMA device)."""
    from mooncake_k8s.transfer.rdma import detect_rdma

    found = detect_rdma()
    if found.available:
        pytest.skip(f"this machine has RDMA ({found.reason}): the refusal cannot happen here")
    r = CliRunner().invoke(main, ["prefill", "--transfer-protocol", "rdma", "--metrics-port",
                                  "-1"])
    assert r.exit_code == 2
    assert "RDMA unavailable here" in r.output and found.reason in r.output
    assert "use auto" in r.output
