"""`mooncake up --prefill N --prefill-group-size G`: which arguments are refused (before any
process starts), which pipeline flags each prefill instance gets, and that the real `mooncake
prefill` command parses those flags into the stage they describe (and the Kubernetes form
`{group}`/`{index}`/`auto` likewise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.cli.serving import _pipeline, prefill
from mooncake_k8s.up import LocalCluster, UpConfig, group_problem, stage_args

PORTS = [5001, 5002, 5003, 5004]


@pytest.mark.parametrize(("n", "g", "engine", "words"), [
    (3, 2, "embedded", "--prefill 3 is not a positive multiple of --prefill-group-size 2"),
    (2, 4, "embedded", "--prefill 2 is not a positive multiple of --prefill-group-size 4"),
    (2, 2, "vllm", "--prefill-group-size 2 needs --engine embedded"),
    (2, 2, "sglang", "the sglang worker runs no pipeline stage"),
    (2, 0, "embedded", "--prefill-group-size must be at least 1"),
])
def test_bad_groups_are_refused_with_the_flag_named(n: int, g: int, engine: str,
                                                    words: str) -> None:
    problem = group_problem(n, g, engine)
    assert problem is not None and words in problem


@pytest.mark.parametrize(("n", "g", "engine"), [(1, 1, "embedded"), (3, 1, "vllm"),
                                                (2, 2, "embedded"), (6, 3, "embedded")])
def test_whole_groups_are_accepted(n: int, g: int, engine: str) -> None:
    assert group_problem(n, g, engine) is None


@pytest.mark.parametrize(("argv", "words"), [
    (["--prefill", "3", "--prefill-group-size", "2"], "not a positive multiple"),
    (["--prefill", "2", "--prefill-group-size", "2", "--engine", "vllm"],
     "needs --engine embedded"),
    (["--prefill-group-size", "0"], "--prefill-group-size"),
])
def test_the_cli_refuses_before_starting_anything(argv: list[str], words: str,
                                                  tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["up", "--log-dir", str(tmp_path), *argv])
    assert r.exit_code == 2, r.output
    assert words in r.output
    assert not list(tmp_path.iterdir())  # no process was started (none wrote a log)


def test_local_cluster_refuses_a_partial_group() -> None:
    with pytest.raises(ValueError, match="not a positive multiple"):
        LocalCluster(UpConfig(prefill=3, prefill_group_size=2))


def test_consecutive_instances_form_groups_and_chain_to_the_next_port() -> None:
    got = [stage_args(i, 2, "127.0.0.1", PORTS) for i in range(4)]
    assert got == [
        ["--pipeline-group", "g0", "--pipeline-group-size", "2", "--pipeline-stage", "0",
         "--pipeline-next", "127.0.0.1:5002"],
        ["--pipeline-group", "g0", "--pipeline-group-size", "2", "--pipeline-stage", "1"],
        ["--pipeline-group", "g1", "--pipeline-group-size", "2", "--pipeline-stage", "0",
         "--pipeline-next", "127.0.0.1:5004"],
        ["--pipeline-group", "g1", "--pipeline-group-size", "2", "--pipeline-stage", "1"],
    ]
    assert stage_args(0, 1, "127.0.0.1", PORTS) == []  # single instances: no flags


def _parsed(args: list[str]) -> dict[str, object]:
    ctx = prefill.make_context("prefill", list(args))
    return _pipeline(ctx.params)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_prefill_command_takes_the_flags_up_gives(index: int) -> None:
    """Stage 1 of 2 has no next stage; stage 0 passes to the next instance's port."""
    got = _parsed(stage_args(index, 2, "127.0.0.1", PORTS))
    assert got["pipeline_group"] == f"g{index // 2}"
    assert got["pipeline_group_size"] == 2
    assert got["pipeline_stage"] == index % 2
    assert got["pipeline_next"] == ("" if index % 2 else f"127.0.0.1:{PORTS[index + 1]}")


@pytest.mark.parametrize(("index", "group", "stage", "nxt"), [
    (0, "g0", 0, "demo-prefill-1.demo-prefill:1"),
    (1, "g0", 1, ""),
    (2, "g1", 0, "demo-prefill-3.demo-prefill:1"),
])
def test_the_pod_form_resolves_from_the_pod_index(monkeypatch: pytest.MonkeyPatch, index: int,
                                                  group: str, stage: int, nxt: str) -> None:
    """What the operator renders (pods_env.pipeline_env): one template for every pod."""
    monkeypatch.setenv("MOONCAKE_POD_INDEX", str(index))
    got = _parsed(["--pipeline-group", "g{group}", "--pipeline-group-size", "2",
                   "--pipeline-stage", "auto", "--pipeline-next",
                   "demo-prefill-{index}.demo-prefill:1"])
    assert (got["pipeline_group"], got["pipeline_stage"], got["pipeline_next"]) == (
        group, stage, nxt)
