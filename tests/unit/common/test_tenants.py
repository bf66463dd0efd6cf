"""The API-keys file's tenants and quotas (common.tenants): what `mooncake up` hands the store
master, and a clear error naming the line for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli.main import _tenant_quotas
from mooncake_k8s.common.tenants import read_api_keys
from mooncake_k8s.conductor.http.api import load_api_keys

GiB = 1 << 30


def write(tmp_path: Path, text: str) -> str:
    f = tmp_path / "keys"
    f.write_text(text)
    return str(f)


def test_keys_tenants_and_quotas_and_the_masters_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "# KEY TENANT quotas\nsk-a1 team-a dram=1GiB ssd=4GiB\n"
                           "sk-a2 team-a\nsk-b team-b ssd=512MiB  # SSD only\nsk-pub\n")
    keys = read_api_keys(path)
    assert keys.tenants == {"sk-a1": "team-a", "sk-a2": "team-a", "sk-b": "team-b",
                            "sk-pub": ""}
    assert keys.quotas == {"team-a": (GiB, 4 * GiB), "team-b": (None, 512 << 20)}
    flags = keys.quota_flags()
    assert flags == ["--tenant-quota", f"team-a={GiB},{4 * GiB}",
                     "--tenant-quota", f"team-b=-,{512 << 20}"]
    # The master reads back exactly these quotas, and the Conductor the keys' tenants.
    assert _tenant_quotas(tuple(flags[1::2])) == keys.quotas
    assert load_api_keys(path) == keys.tenants


@pytest.mark.parametrize(("text", "why"), [
    ("sk-1 a b\n", r"keys:1: expected 'KEY \[TENANT\]"),
    ("sk-1 dram=1GiB\n", "keys:1: a quota .* needs a TENANT"),
    ("sk-1 a dram=lots\n", "keys:1: dram=: size 'lots'"),
    ("sk-1 a disk=1GiB\n", "keys:1: unknown attribute 'disk'"),
    ("sk-1 a dram=1G dram=2G\n", "keys:1: dram= given twice"),
    ("sk-1 a dram=1GiB\nsk-2 a dram=2GiB\n", "keys:2: tenant 'a' has another quota on line 1"),
    ("sk-1 dram=1GiB a\n", "expected 'KEY"),
    ("# nothing\n", "no API keys"),
])
def test_mistakes_name_the_line(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        read_api_keys(write(tmp_path, text))


def test_up_refuses_a_bad_file_before_starting_anything(tmp_path: Path) -> None:
    from mooncake_k8s.cli.main import main

    path = write(tmp_path, "sk-1 a dram=lots\n")
    res = CliRunner().invoke(main, ["up", "--api-keys-file", path])
    assert res.exit_code == 2
    assert "--api-keys-file" in res.output and "dram=: size 'lots'" in res.output
