"""Option types and option groups shared by every `mooncake` command module."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
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


class MastersType(click.ParamType):  # type: ignore[type-arg]
    """One store master address or a comma-separated list of them (an HA group)."""

    name = "host:port[,host:port...]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        from mooncake_k8s.common.errors import InvalidArgument
        from mooncake_k8s.store.client.masterlink import parse_masters

        try:
            return ",".join(parse_masters(str(value)))
        except InvalidArgument as e:
            self.fail(str(e), param, ctx)


MASTERS = MastersType()


def _warn_no_token(token: str) -> None:
    if not token:
        click.echo(
            "warning: no cluster token set (--token / MOONCAKE_CLUSTER_TOKEN); internal "
            "endpoints accept anyone who can reach them",
            err=True,
        )


_ANY_NAMES = ("", "*")
"""Spellings that servers (grpc, aiohttp, socket.bind) take as "every interface" without any
resolution: an empty host and a bare wildcard."""


def _is_unspecified(text: str) -> bool:
    """True for 0.0.0.0 / :: in any spelling ipaddress accepts, including a v4-mapped
    ::ffff:0.0.0.0 (Linux binds that to every IPv4 interface) and a zone id (::%lo)."""
    ip = ipaddress.ip_address(text.partition("%")[0])
    if ip.is_unspecified:
        return True
    return isinstance(ip, ipaddress.IPv6Address) and bool(
        ip.ipv4_mapped and ip.ipv4_mapped.is_unspecified
    )


def bind_addresses(host: str) -> list[str]:
    """Every address `host` stands for when a server binds to it, as text.

    A literal IPv4/IPv6 address is parsed directly; anything else goes through
    `getaddrinfo(AI_PASSIVE)`, which is what the servers do, so legacy forms that
    `inet_aton` accepts ("0", "0x0", "0.0", "000.000.000.000") and host names (an /etc/hosts
    entry pointing at 0.0.0.0) are judged by what they resolve to, never by their spelling.
    Raises ValueError when the name does not resolve.
    """
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text in _ANY_NAMES:
        return ["0.0.0.0"]
    with contextlib.suppress(ValueError):
        return [str(ipaddress.ip_address(text.partition("%")[0]))]
    try:
        infos = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from e
    return sorted({str(info[4][0]) for info in infos})


def any_address(host: str) -> str | None:
    """The unspecified address `host` binds to (e.g. "0.0.0.0" for "0"), or None when it
    binds specific interfaces only. Raises ValueError when `host` does not resolve."""
    for addr in bind_addresses(host):
        if _is_unspecified(addr):
            return addr
    return None


def _check_bind(host: str, allow_any: bool) -> str:
    """Refuse a --host that binds every interface unless --allow-any-address was given.

    The one guard every server command calls (store master and node, prefill, decode,
    Conductor) before it binds anything. Internal endpoints accept anyone who can reach them
    (at best a shared token), so exposing them on every interface must be a decision.

    Returns the host to bind: an allowed any-address in its canonical spelling ("0" becomes
    "0.0.0.0", "0:0::0" becomes "::", since gRPC rejects the legacy forms that plain sockets
    accept), anything else unchanged. Callers that ignore the result lose nothing but that.
    """
    try:
        addr = any_address(host)
    except ValueError as e:
        raise click.BadParameter(
            f"{e}; give an IP address or a name this host resolves", param_hint="--host"
        ) from e
    if addr is None:
        return host
    if not allow_any:
        shown = "" if host.strip() == addr else f" ({host!r} means {addr})"
        raise click.BadParameter(
            f"refusing to bind every interface{shown}; pass --allow-any-address if you mean it",
            param_hint="--host",
        )
    return addr


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
