"""Start-up errors as messages: one line naming the flag and its value, exit code 2, no
traceback.

`guard` wraps the callback of every command that binds a port, in one place (`cli.main` calls
it on the whole command tree once every group is registered), so no server module has to know
its flags. Before the command runs it checks what would otherwise fail deep inside a server's
start: each port flag's address can be bound (a second store master on one host with the
default `--metrics-port` used to die with an `OSError` traceback), the `--host` address
belongs to this machine, and the model `--model` names (or the built-in one) is there. While
the command starts, a validation error it raises (`click.BadParameter`) and a bind that still
fails (another process took the port in between) become the same one-line message.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from mooncake_k8s.cli.options import bind_addresses

EXIT_CODE = 2
"""What a start-up error exits with: the code click gives any other bad flag."""
HOST_FLAGS = ("host", "listen_host")
"""Parameter names that say where a command's servers bind (the first one present wins)."""
BIND_FAILED = re.compile(r"(?i)address already in use|failed to bind|cannot bind|"
                         r"cannot assign requested address")
_SECRET = re.compile(r"(?i)token|key|password|secret|url")
"""Parameters whose values a message never shows (a Redis URL may hold a password)."""


class StartupError(click.ClickException):
    """A flag whose value keeps the command from starting; shown as `Error: <flag> <value>:
    <problem>` on one line."""

    exit_code = EXIT_CODE

    def __init__(self, flag: str, value: Any, problem: str) -> None:
        shown = "" if value is None or value == "" else f" {_show(flag, value)}"
        super().__init__(f"{flag}{shown}: {problem}")
        self.flag = flag


def _show(flag: str, value: Any) -> str:
    return "(hidden)" if _SECRET.search(flag) else shlex.quote(str(value))


SUPERVISORS = {"up"}
"""Commands whose port flags are their children's: each child reports its own start-up error
and the supervisor's restart policy judges the exits (a port taken is a crash loop there)."""


def guard(group: click.Group) -> None:
    """Wrap every command under `group` that has a port flag (the servers)."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            guard(command)
        elif (command.callback is not None and name not in SUPERVISORS
              and any(_port_params(command))):
            command.callback = _guarded(command, command.callback)


def _guarded(command: click.Command, callback: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kw: Any) -> Any:
        preflight(command, kw)
        try:
            return callback(*args, **kw)
        except click.BadParameter as e:
            raise _from_bad_parameter(command, kw, e) from None
        except (OSError, RuntimeError) as e:
            mapped = from_bind_error(command, kw, e)
            if mapped is None:
                raise
            raise mapped from None

    run.__doc__ = callback.__doc__
    run.__name__ = getattr(callback, "__name__", "run")
    return run


def _port_params(command: click.Command) -> Iterator[click.Parameter]:
    for p in command.params:
        if p.name and (p.name == "port" or p.name.endswith("_port")):
            yield p


def _flag(p: click.Parameter) -> str:
    longs = [o for o in p.opts if o.startswith("--")]
    return (longs or p.opts or [p.name or "?"])[0]


def _host_of(command: click.Command, kw: dict[str, Any], port_name: str) -> tuple[str, str]:
    """The flag and address a port parameter binds to: `--metrics-host` for the metrics port
    when given, else the command's host flag, else loopback."""
    by_name = {p.name: p for p in command.params}
    for name in (("metrics_host",) if port_name == "metrics_port" else ()) + HOST_FLAGS:
        if kw.get(name):
            return _flag(by_name[name]), str(kw[name])
    return "--host", "127.0.0.1"


def preflight(command: click.Command, kw: dict[str, Any]) -> None:
    """Raise `StartupError` for an address this command could not bind or a model that is not
    there, before anything starts. A host that does not resolve is left to the command's own
    check (`options._check_bind`), which names it."""
    for p in _port_params(command):
        port = kw.get(p.name or "")
        if not isinstance(port, int) or port < 0:
            continue  # -1: off
        host_flag, host = _host_of(command, kw, p.name or "")
        try:
            addresses = bind_addresses(host)
        except ValueError:
            continue
        _check_port(_flag(p), port, host_flag, host, addresses)
    _check_model(command, kw)


def _check_port(flag: str, port: int, host_flag: str, host: str, addresses: list[str]) -> None:
    """One port flag's bind on every address its host stands for. In use (or privileged) on
    any of them is the port's problem; an address that cannot be bound is the host's only when
    none can (a name may also resolve to an IPv6 address where IPv6 is off)."""
    problems = {addr: _bind_problem(addr, port) for addr in addresses}
    for addr, problem in problems.items():
        if problem is not None and port and problem[0] == errno.EADDRINUSE:
            raise StartupError(flag, port, f"address already in use ({_where(addr, port)}: "
                               "another process listens there; give another port)")
        if problem is not None and port and problem[0] == errno.EACCES:
            raise StartupError(flag, port, f"cannot bind {_where(addr, port)}: {problem[1]} "
                               "(ports below 1024 need privileges)")
    failed = [(addr, problem) for addr, problem in problems.items() if problem is not None]
    if failed and len(failed) == len(problems):
        addr, (_, reason) = failed[0]
        raise StartupError(host_flag, host, f"cannot bind {addr}: {reason}")


def _where(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _bind_problem(addr: str, port: int) -> tuple[int, str] | None:
    """(errno, reason) when `addr:port` cannot be bound now, as a server would bind it
    (SO_REUSEADDR, so connections in TIME_WAIT do not count), else None."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr.partition("%")[0], port))
        except OSError as e:
            return e.errno or 0, e.strerror or str(e)
    return None


def _check_model(command: click.Command, kw: dict[str, Any]) -> None:
    """The model a command will load: a Hugging Face directory with its config.json, or the
    built-in one, whose package setup installs."""
    if "model" not in {p.name for p in command.params}:
        return
    model = kw.get("model")
    if model:
        path = Path(os.path.expanduser(str(model)))
        if not path.is_dir():
            raise StartupError("--model", model, "no such directory")
        if not (path / "config.json").is_file():
            raise StartupError("--model", model,
                               "no config.json there: not a Hugging Face model directory")
        return
    from mooncake_k8s.engine.loading import ModelLoadError, builtin_gguf_path

    try:
        builtin_gguf_path()
    except ModelLoadError as e:
        raise StartupError("--model", "(built-in)", str(e)) from None


def _from_bad_parameter(command: click.Command, kw: dict[str, Any],
                        e: click.BadParameter) -> click.ClickException:
    """A validation error of the command itself, on one line with the value it refused."""
    param = e.param
    if param is None and e.param_hint:
        hint = str(e.param_hint).strip("'\"")
        param = next((p for p in command.params if hint in p.opts), None)
    if param is None:
        return StartupError(str(e.param_hint or "error"), None, e.message)
    return StartupError(_flag(param), kw.get(param.name or ""), e.message)


def from_bind_error(command: click.Command, kw: dict[str, Any],
                    e: BaseException) -> StartupError | None:
    """A bind that failed during start (after `preflight` passed: another process took the
    port in between), named by the port flag whose value the error mentions; None when `e`
    is not a bind failure."""
    text = str(e)
    if not ((isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL))
            or BIND_FAILED.search(text)):
        return None
    named = [p for p in _port_params(command)
             if isinstance(kw.get(p.name or ""), int) and kw[p.name or ""] > 0
             and re.search(rf":{kw[p.name or '']}\b", text)]
    reason = e.strerror if isinstance(e, OSError) and e.strerror else text
    if len(named) == 1:
        return StartupError(_flag(named[0]), kw[named[0].name or ""], f"cannot bind: {reason}")
    ports = ", ".join(f"{_flag(p)} {kw.get(p.name or '')}" for p in _port_params(command))
    return StartupError("a port", None, f"cannot bind ({ports}): {reason}")
