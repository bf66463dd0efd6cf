"""Start-up errors are messages: real `mooncake` processes against real listeners, each
refused with exit code 2 and one line on stderr that names the flag and its value."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from mooncake_k8s.cli import main
from mooncake_k8s.cli.startup import StartupError, from_bind_error

TOKEN = "startup-test-token"
UNASSIGNED = "192.0.2.1"
"""TEST-NET-1 (RFC 5737): an address no machine running this suite has on an interface."""


def _mooncake(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN}
    return subprocess.run([sys.executable, "-m", "mooncake_k8s.cli", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _one_line(r: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The process exited 2 with exactly one stderr line that holds every fragment."""
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port a real listener holds (another process's server, as far as ours can tell)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(("args", "flag"), [
    (["store", "master", "--port", "0", "--metrics-port", "{busy}"], "--metrics-port"),
    (["store", "master", "--port", "{busy}", "--metrics-port", "-1"], "--port"),
    (["store", "master", "--port", "0", "--metrics-port", "-1", "--fast-port", "{busy}"],
     "--fast-port"),
    (["store", "node", "--port", "{busy}", "--metrics-port", "-1"], "--port"),
    (["prefill", "--port", "0", "--metrics-port", "{busy}"], "--metrics-port"),
    (["decode", "--port", "{busy}", "--metrics-port", "-1"], "--port"),
    (["conductor", "--port", "{busy}", "--metrics-port", "-1", "--prefill", "127.0.0.1:1",
      "--decode", "127.0.0.1:2"], "--port"),
    (["operator", "--metrics-port", "0", "--health-port", "{busy}"], "--health-port"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_a_port_in_use_is_named_with_its_flag(busy_port: int, args: list[str],
                                              flag: str) -> None:
    r = _mooncake(*(a.format(busy=busy_port) for a in args))
    line = _one_line(r, f"{flag} {busy_port}:", "address already in use")
    assert line.startswith("Error: ")


def _wait_listening(port: int, proc: subprocess.Popen[str], deadline_s: float = 60) -> None:
    """Readiness, not timing: return once something accepts on `port` (the master's metrics
    server starts last); fail if the master died first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[1]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"the first master never listened on {port}")


def test_a_second_master_on_one_host_names_the_metrics_port() -> None:
    """The case found: two masters on one host, each with its own --port, the same (default)
    --metrics-port. The second one is refused with a message, not an OSError traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics = s.getsockname()[1]
    first = subprocess.Popen(
        [sys.executable, "-m", "mooncake_k8s.cli", "store", "master", "--port", "0",
         "--metrics-port", str(metrics), "--fast-port", "-1", "--log-format", "text"],
        env={**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(metrics, first)
        r = _mooncake("store", "master", "--port", "0", "--metrics-port", str(metrics))
        _one_line(r, f"--metrics-port {metrics}:", "already in use")
        assert first.poll() is None  # the first master is untouched
    finally:
        first.terminate()
        first.communicate(timeout=30)


@pytest.mark.parametrize("args", [
    ["store", "master", "--port", "0", "--metrics-port", "-1"],
    ["store", "node", "--port", "0", "--metrics-port", "-1"],
    ["prefill", "--port", "0", "--metrics-port", "-1"],
], ids=lambda a: " ".join(a[:2]))
def test_an_address_of_another_machine_is_named_with_host(args: list[str]) -> None:
    r = _mooncake(*args, "--host", UNASSIGNED)
    _one_line(r, f"--host {UNASSIGNED}:", "cannot bind")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_master_binds_a_host_name() -> None:
    """`--host localhost` (a name, not an address) serves: the gRPC port accepts, and the fast
    path answers its hello with the token; it used to die in the fast path's start with a
    traceback (`ipaddress` refused the name)."""
    from mooncake_k8s.store.wire import MAGIC, VERSION

    port, fast = _free_port(), _free_port()
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake_k8s.cli", "store", "master", "--host", "localhost",
         "--port", str(port), "--fast-port", str(fast), "--metrics-port", "-1"],
        env={**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(fast, master)
        with socket.create_connection(("localhost", fast), timeout=10) as s:
            s.sendall(MAGIC + bytes([VERSION]) + len(TOKEN).to_bytes(2, "little")
                      + TOKEN.encode())
            assert s.recv(1) == b"\x00"  # ok: our master's fast path, token accepted
        with socket.create_connection(("localhost", port), timeout=10):
            pass
        assert master.poll() is None
    finally:
        master.terminate()
        _, err = master.communicate(timeout=30)
    assert "Traceback" not in err, err


@pytest.mark.parametrize("args", [
    ["store", "master", "--port", "0", "--metrics-port", "-1"],
    ["store", "node", "--port", "0", "--metrics-port", "-1"],
], ids=lambda a: " ".join(a[:2]))
def test_a_host_name_that_does_not_resolve_is_named_with_host(args: list[str]) -> None:
    host = "no-such-host.invalid"  # RFC 6761: never resolves
    _one_line(_mooncake(*args, "--host", host), f"--host {host}:", "cannot resolve")


def test_the_conductors_metrics_host_is_named_for_its_port() -> None:
    r = _mooncake("conductor", "--port", "0", "--metrics-port", "0", "--metrics-host",
                  UNASSIGNED, "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2")
    _one_line(r, f"--metrics-host {UNASSIGNED}:", "cannot bind")


@pytest.mark.parametrize("command", [["prefill"], ["decode"], ["conductor", "--prefill",
                                                                "127.0.0.1:1", "--decode",
                                                                "127.0.0.1:2"]],
                         ids=lambda c: c[0])
def test_a_missing_model_is_named(tmp_path: object, command: list[str]) -> None:
    missing = os.path.join(str(tmp_path), "no-such-model")
    r = _mooncake(*command, "--port", "0", "--metrics-port", "-1", "--model", missing)
    _one_line(r, f"--model {missing}:", "no such directory")
    empty = str(tmp_path)
    r = _mooncake(*command, "--port", "0", "--metrics-port", "-1", "--model", empty)
    _one_line(r, f"--model {empty}:", "no config.json")


def test_mooncake_up_leaves_its_childrens_ports_to_them() -> None:
    """`up --port` is the Conductor's: the Conductor child reports it, and up's restart policy
    turns the repeated exits into a crash loop (tests/e2e/test_up_supervise.py), so up itself
    does not refuse it."""
    from mooncake_k8s.cli.startup import SUPERVISORS

    up = main.commands["up"]
    assert "up" in SUPERVISORS and up.callback is not None
    assert not hasattr(up.callback, "__wrapped__") and up.callback.__module__ == (
        "mooncake_k8s.cli.serving")
    conductor = main.commands["conductor"]
    assert conductor.callback is not None
    assert conductor.callback.__module__ == "mooncake_k8s.cli.startup"


def test_a_validation_error_is_one_line_with_the_flag() -> None:
    r = _mooncake("store", "master", "--port", "0", "--metrics-port", "-1",
                  "--high-watermark", "0.5", "--low-watermark", "0.9")
    _one_line(r, "--low-watermark 0.9:", "below --high-watermark")


def test_a_secret_value_is_never_shown() -> None:
    assert StartupError("--token", TOKEN, "too short").format_message() == (
        "--token (hidden): too short")
    url = "redis://:s3cret@redis:6379/0"
    assert "s3cret" not in StartupError("--redis-url", url, "unreachable").format_message()
    assert StartupError("--port", 80, "x").format_message() == "--port 80: x"


def test_a_bind_that_fails_after_the_check_is_named_by_its_port() -> None:
    """Another process may take a port between the check and the bind: the error the server
    raises then is mapped by the port it names (the master's gRPC bind says host:port)."""
    master = main.commands["store"].commands["master"]  # type: ignore[attr-defined]
    kw = {"host": "127.0.0.1", "port": 50999, "metrics_port": 9999, "fast_port": 0}
    err = OSError("cannot bind the master server to 127.0.0.1:50999: Failed to bind")
    got = from_bind_error(master, kw, err)
    assert isinstance(got, StartupError)
    assert got.format_message().startswith("--port 50999: cannot bind")
    anonymous = OSError(errno.EADDRINUSE, "Address already in use")
    got = from_bind_error(master, kw, anonymous)
    assert got is not None and "--metrics-port 9999" in got.format_message()
    assert got.exit_code == 2
    assert from_bind_error(master, kw, OSError(errno.ENOENT, "No such file")) is None
