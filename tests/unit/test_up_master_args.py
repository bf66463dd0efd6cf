"""`mooncake up`'s store master command line: fan-out and tenant quotas reach it in the form
`mooncake store master` parses (nothing is started)."""

from __future__ import annotations

from pathlib import Path

from mooncake_k8s.cli.main import store_master
from mooncake_k8s.up import LocalCluster, UpConfig


def parsed(tmp_path: Path, **kw: object) -> dict[str, object]:
    args = LocalCluster(UpConfig(log_dir=str(tmp_path), **kw)).master_args(9100)  # type: ignore[arg-type]
    assert args[:2] == ["store", "master"]
    return dict(store_master.make_context("master", args[2:]).params)


def test_fanout_is_off_by_default_and_on_when_asked(tmp_path: Path) -> None:
    assert parsed(tmp_path)["fanout"] is False
    assert parsed(tmp_path, store_fanout=True)["fanout"] is True


def test_api_keys_quotas_reach_the_master(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-a team-a dram=1MiB\nsk-b team-b\n")
    got = parsed(tmp_path, api_keys_file=str(keys))
    assert got["tenant_quota"] == ("team-a=1048576,-",)  # team-b has no quota


def test_the_up_command_takes_the_flag() -> None:
    from mooncake_k8s.cli.serving import up

    assert up.make_context("up", ["--store-fanout"]).params["store_fanout"] is True
    assert up.make_context("up", []).params["store_fanout"] is False
