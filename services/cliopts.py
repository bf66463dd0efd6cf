"""Option types and option groups shared by every `mooncake` command module."""

from __future__ import annotations

import re
from typing import Any

import click

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824, '512M' -> 512000000, '4096' -> 4096."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 2GiB, 1000000)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


class SizeType(click.ParamType):  # type: ignore[type-arg]
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()


def _warn_no_token(token: str) -> None:
    if not token:
        click.echo(
            "warning: no cluster token set (--token / MOONCAKE_CLUSTER_TOKEN); internal "
            "endpoints accept anyone who can reach them",
            err=True,
        )


def _check_bind(host: str, allow_any: bool) -> None:
    if host in ("0.0.0.0", "::") and not allow_any:
        raise click.BadParameter(
            "refusing to bind every interface; pass --allow-any-address if you mean it",
            param_hint="--host",
        )


_token_opt = click.option(
    "--token", envvar="MOONCAKE_CLUSTER_TOKEN", default="", show_envvar=True,
    help="Shared cluster token required on internal endpoints.",
)
_log_opts = [
    click.option("--log-level", envvar="MOONCAKE_LOG_LEVEL", default="info", show_default=True,
                 show_envvar=True, type=click.Choice(["debug", "info", "warning", "error"])),
    click.option("--log-format", envvar="MOONCAKE_LOG_FORMAT", default="json", show_default=True,
                 show_envvar=True, type=click.Choice(["json", "text"])),
]


def _with_logs(f: Any) -> Any:
    for opt in reversed(_log_opts):
        f = opt(f)
    return f
