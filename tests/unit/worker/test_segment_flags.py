"""`--local-segment-size` on both worker roles: the DRAM each serves to the store on its host.

A size between 0 (no segment) and 1MiB, or not a size at all, is refused at start with the
flag's name (and the variable's, when it came from the environment), before anything binds.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.cli.options import parse_size
from mooncake_k8s.cli.serving import DECODE_SEGMENT_SIZE, PREFILL_SEGMENT_SIZE


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(("value", "says"), [
    ("100", "100 bytes: 0 (no segment) or at least 1MiB"),
    ("1023KiB", "1047552 bytes: 0 (no segment) or at least 1MiB"),
    ("lots", "not a size: 'lots'"),
    ("-1", "not a size: '-1'"),
])
def test_a_bad_segment_size_is_refused_by_flag(role: str, value: str, says: str) -> None:
    r = CliRunner().invoke(main, [role, "--local-segment-size", value, "--metrics-port", "-1"])
    assert r.exit_code == 2, r.output
    assert "--local-segment-size" in r.output and says in r.output


def test_the_environment_variable_is_checked_too() -> None:
    r = CliRunner().invoke(main, ["prefill", "--metrics-port", "-1"],
                           env={"MOONCAKE_LOCAL_SEGMENT_SIZE": "512KiB"})
    assert r.exit_code == 2
    assert "MOONCAKE_LOCAL_SEGMENT_SIZE" in r.output and "at least 1MiB" in r.output


def test_both_roles_serve_a_segment_by_default() -> None:
    """Prefill keeps reusable prefixes (a 3K-token prompt of the built-in model is ~135 MB of
    KV): its default holds a few of them; decode's holds the requests it is handed."""
    defaults = {}
    for role in ("prefill", "decode"):
        (opt,) = [p for p in main.commands[role].params if p.name == "local_segment_size"]
        defaults[role] = parse_size(str(opt.default))
        assert "(0 = none)" in (getattr(opt, "help", "") or "")
    assert defaults == {"prefill": parse_size(PREFILL_SEGMENT_SIZE),
                        "decode": parse_size(DECODE_SEGMENT_SIZE)}
    assert defaults["prefill"] >= 3 * 135_000_000 and defaults["decode"] >= 1 << 20
