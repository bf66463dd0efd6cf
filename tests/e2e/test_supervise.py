"""`mooncake up` as a process manager: the real command, real processes, the real model.

One `mooncake up` (master, store node, 1 prefill, 1 decode, Conductor) serves the module. The
first test kill -9s the decode and the prefill worker and expects the system to serve again
after the supervisor restarts them with the same identity (the Conductor re-admits them by
polling); the second stops `up` with SIGINT and expects every process it ever started, and
everything in their process groups, to be gone. A separate `up` whose Conductor can never
bind its port must stop itself as a crash loop, with a message naming the Conductor.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.common.netutil import free_service_port

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(600)


@dataclass
class Up:
    popen: subprocess.Popen[bytes]
    port: int
    log_dir: Path
    out: Path
    err: Path

    def status(self) -> dict[str, dict[str, Any]]:
        children: dict[str, dict[str, Any]] = json.loads(
            (self.log_dir / "up-status.json").read_text())["children"]
        return children

    def all_pids(self) -> list[int]:
        return [p for c in self.status().values() for p in c["pids"]]

    def text(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")


def start_up(tmp: Path, port: int, *extra: str) -> Up:
    out, err = tmp / "up.out", tmp / "up.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        popen = subprocess.Popen(
            [sys.executable, "-m", "mooncake_k8s.cli", "up", "--port", str(port),
             "--log-dir", str(tmp / "logs"), "--store-size", "256MiB", "--threads", "1",
             "--ready-timeout", "300", *extra],
            stdout=o, stderr=e, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Up(popen, port, tmp / "logs", out, err)


def leftovers(pids: list[int]) -> list[str]:
    """Live processes that are one of `pids` or in a process group led by one of them."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(d.name) in pids or int(fields[2]) in pids:
            found.append(f"{d.name} state={fields[0]} pgrp={fields[2]} {stat[:80]}")
    return found


def complete(port: int, prompt: str) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {"decode": r.headers.get("x-mooncake-decode"), **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, OSError) as e:
        return 0, {"error": str(e)}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = start_up(tmp_path_factory.mktemp("up"), free_service_port())
    try:
        deadline = time.monotonic() + 400
        while "mooncake is up" not in u.out.read_text(errors="replace"):
            assert u.popen.poll() is None, u.text()
            assert time.monotonic() < deadline, u.text()
            time.sleep(0.5)
        yield u
    finally:
        if u.popen.poll() is None:
            u.popen.send_signal(signal.SIGINT)
            try:
                u.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                u.popen.kill()
                u.popen.wait()


def test_killed_workers_are_restarted_and_serving_resumes(up: Up) -> None:
    status, body = complete(up.port, "Before the crash")
    assert status == 200, body
    before = up.status()
    assert all(c["restarts"] == 0 for c in before.values()), before
    for name in ("decode-0", "prefill-0"):
        os.kill(before[name]["pid"], signal.SIGKILL)

    # Bounded: a worker restarts in well under a minute on this 2-core box; 180 s is slack.
    deadline = time.monotonic() + 180
    while True:
        status, body = complete(up.port, "After the crash")
        if status == 200:
            break
        assert status in (0, 503), (status, body)  # unavailable while the workers restart
        assert up.popen.poll() is None, up.text()
        assert time.monotonic() < deadline, (status, body, up.text())
        time.sleep(1)
    assert body["decode"] == "decode-0" and body["usage"]["completion_tokens"] >= 1, body

    after = up.status()
    for name in ("decode-0", "prefill-0"):
        c = after[name]
        assert c["restarts"] == 1 and c["last_exit"] == "signal SIGKILL", after
        assert c["pid"] != before[name]["pid"] and c["pids"] == [before[name]["pid"], c["pid"]]
        assert f"{name} (pid {before[name]['pid']}) exited with signal SIGKILL; restarting" \
            in up.text()
        assert f"{name} restarted (pid {c['pid']}, restart 1)" in up.text()
    for name in ("master", "store-node", "conductor"):
        assert after[name]["restarts"] == 0 and after[name]["pid"] == before[name]["pid"]
    assert not leftovers([before["decode-0"]["pid"], before["prefill-0"]["pid"]])


def test_sigint_stops_every_child(up: Up) -> None:
    """Runs after the restart test: the pids include the killed and the restarted workers."""
    pids = up.all_pids()
    running = [c["pid"] for c in up.status().values()]
    assert len(running) == 5 and all(Path(f"/proc/{p}").exists() for p in running)
    up.popen.send_signal(signal.SIGINT)
    assert up.popen.wait(timeout=60) == 0, up.text()
    assert "stopped" in up.text()
    assert not leftovers(pids), leftovers(pids)


def test_a_child_that_can_never_start_stops_up_as_a_crash_loop(
        tmp_path: Path) -> None:
    """The Conductor's port is taken: it exits at every start, and after --max-restarts
    restarts `up` stops everything with a message naming it, exiting non-zero."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        u = start_up(tmp_path, squatter.getsockname()[1], "--max-restarts", "2")
        try:
            code = u.popen.wait(timeout=300)
        finally:
            if u.popen.poll() is None:
                u.popen.kill()
                u.popen.wait()
    text = u.text()
    assert code == 1, text
    assert "error: conductor is crash-looping: it exited 3 times within 120s (last: exit code" \
        in text, text
    assert "Last log lines of conductor:" in text
    assert "address already in use" in text.lower(), text
    st = u.status()
    assert st["conductor"]["restarts"] == 2 and len(st["conductor"]["pids"]) == 3, st
    assert "mooncake is up" not in text
    assert not leftovers(u.all_pids()), leftovers(u.all_pids())
