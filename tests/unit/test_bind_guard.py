"""The any-address guard: every spelling of "all interfaces" is caught, specific ones pass."""

from __future__ import annotations

import click
import pytest

from mooncake_k8s.cli.options import _check_bind, any_address, bind_addresses

ANY_V4 = ["0.0.0.0", "0", "00", "0x0", "0.0", "000.000.000.000", "", "*", " 0.0.0.0 "]
ANY_V6 = ["::", "::0", "0::", "0:0:0:0:0:0:0:0", "0000:0000::0000", "[::]", "::%lo",
          "::ffff:0.0.0.0"]
SPECIFIC = ["127.0.0.1", "127.1", "0177.0.0.1", "localhost", "::1", "[::1]", "10.0.0.7"]


@pytest.mark.parametrize("host", ANY_V4 + ANY_V6)
def test_every_spelling_of_any_needs_the_flag(host: str) -> None:
    assert any_address(host) is not None
    with pytest.raises(click.BadParameter, match="--allow-any-address"):
        _check_bind(host, allow_any=False)
    assert _check_bind(host, allow_any=True) in ("0.0.0.0", "::", "::ffff:0:0")


@pytest.mark.parametrize("host", SPECIFIC)
def test_specific_addresses_pass_unchanged(host: str) -> None:
    assert any_address(host) is None
    assert _check_bind(host, allow_any=False) == host


def test_message_says_what_the_spelling_means() -> None:
    with pytest.raises(click.BadParameter, match=r"'0:0:0:0:0:0:0:0' means ::"):
        _check_bind("0:0:0:0:0:0:0:0", allow_any=False)
    assert bind_addresses("0x0") == ["0.0.0.0"]


def test_unresolvable_name_is_a_clear_error() -> None:
    with pytest.raises(click.BadParameter, match=r"cannot resolve 'no-such-host\.invalid'"):
        _check_bind("no-such-host.invalid", allow_any=True)
