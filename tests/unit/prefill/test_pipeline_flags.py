"""`mooncake prefill`'s pipeline flags: resolved (auto stage, {index} template) and refused
with an error naming the flag, before any engine loads."""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main as cli
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.prefill.pipeline.config import (
    check_pipeline,
    resolve_next,
    resolve_stage,
    stage_layers,
)


def _refused(*args: str, env: dict[str, str] | None = None) -> str:
    res = CliRunner().invoke(cli, ["prefill", "--metrics-port", "-1", *args], env=env)
    assert res.exit_code == 2, res.output
    return res.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--pipeline-group", "g0", "--pipeline-group-size", "2", "--pipeline-stage", "2"],
     "--pipeline-stage 2 must be below --pipeline-group-size 2"),
    (["--pipeline-group", "g0", "--pipeline-group-size", "2"],
     "--pipeline-next is required on stage 0"),
    (["--pipeline-group", "g0", "--pipeline-group-size", "2", "--pipeline-stage", "1",
      "--pipeline-chunk-tokens", "100"], "positive multiple of the engine's prefill chunk (64"),
    (["--pipeline-group", "g0", "--pipeline-group-size", "2", "--pipeline-stage", "1",
      "--pipeline-chunk-tokens", "0"], "positive multiple"),
    (["--pipeline-group-size", "2", "--pipeline-stage", "1"], "needs --pipeline-group"),
    (["--pipeline-stage", "x"], "non-negative integer or 'auto'"),
    (["--pipeline-group", "g/0", "--pipeline-group-size", "2", "--pipeline-stage", "1"],
     "--pipeline-group must be 1-40 of [A-Za-z0-9._-]"),
    (["--pipeline-stage", "1"], "needs --pipeline-group-size > 1"),
])
def test_bad_pipeline_flags_are_refused_by_name(args: list[str], needle: str) -> None:
    assert needle in _refused(*args)


def test_other_engines_are_pointed_at_their_own_pipeline_parallelism() -> None:
    msg = "embedded engine only"
    with pytest.raises(InvalidArgument, match=msg) as e:
        check_pipeline(group="g", group_size=2, stage=1, next_addr="", chunk_tokens=256,
                       compute_chunk=64, timeout_s=10, engine_kind="vllm")
    assert "--pipeline-parallel-size" in str(e.value)


def test_env_vars_are_read() -> None:
    out = _refused(env={"MOONCAKE_PIPELINE_GROUP": "g0", "MOONCAKE_PIPELINE_GROUP_SIZE": "3",
                        "MOONCAKE_PIPELINE_STAGE": "1"})
    assert "--pipeline-next is required on stage 1 of 3" in out


def test_auto_stage_and_next_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_POD_INDEX", raising=False)
    assert resolve_stage("auto", 2, hostname="prefill-5") == 1
    assert resolve_next("prefill-{index}.prefill:50051", hostname="prefill-4") == (
        "prefill-5.prefill:50051")
    monkeypatch.setenv("MOONCAKE_POD_INDEX", "6")
    assert resolve_stage("auto", 4) == 2
    assert resolve_next("p-{index}:1") == "p-7:1"
    monkeypatch.delenv("MOONCAKE_POD_INDEX")
    with pytest.raises(InvalidArgument, match="MOONCAKE_POD_INDEX"):
        resolve_stage("auto", 2, hostname="laptop")


def test_layer_split_covers_every_layer_once() -> None:
    assert [stage_layers(30, 2, s) for s in range(2)] == [(0, 15), (15, 30)]
    spans = [stage_layers(30, 4, s) for s in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == 30
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
