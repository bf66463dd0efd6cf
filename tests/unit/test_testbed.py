"""The multi-host test bed itself (`mooncake_k8s.testbed`): hosts that reach each other only over
the bridge, a link rate, delay and loss in force, a partition that makes connecting fail, byte
counters that move with the traffic. Needs root and network namespaces, as CI has: where they
are missing the bed raises `TestbedUnavailable` and these tests fail, never skip."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_k8s.testbed import Testbed, TestbedUnavailable
from mooncake_k8s.testbed.faults import parse_delay, parse_loss

PAYLOAD = 4 << 20
SINK = ("import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind((sys.argv[1], 9000)); s.listen(); print('listening', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); n = 0\n"
        "    while (b := c.recv(1 << 16)): n += len(b)\n"
        "    c.sendall(str(n).encode()); c.close()\n")


@pytest.fixture
def bed() -> Iterator[Testbed]:
    with Testbed() as b:
        yield b


def _send(addr: str, size: int, timeout: float = 10) -> int:
    with socket.create_connection((addr, 9000), timeout=timeout) as s:
        s.sendall(b"x" * size)
        s.shutdown(socket.SHUT_WR)
        return int(s.recv(64))


def _wait_listening(log: Path) -> None:
    deadline = time.monotonic() + 30
    while "listening" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the sink never listened"
        time.sleep(0.05)


def test_hosts_talk_over_the_bridge_and_counters_say_who(bed: Testbed, tmp_path: Path) -> None:
    a, b = bed.host("a"), bed.host("b", rate="100mbit")
    log = tmp_path / "sink.log"
    proc = b.spawn([sys.executable, "-c", SINK, b.addr], env=dict(os.environ), log=log)
    _wait_listening(log)
    # The process has its own IPC namespace (the transfer engine's "same host" test).
    assert os.readlink(f"/proc/{proc.pid}/ns/ipc") != os.readlink("/proc/self/ns/ipc")
    assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    before = bed.counters()
    assert a.call(_send, b.addr, PAYLOAD) == PAYLOAD
    after = bed.counters()
    sent_a = after["a"][0] - before["a"][0]
    recv_b = after["b"][1] - before["b"][1]
    assert sent_a >= PAYLOAD and recv_b >= PAYLOAD
    assert after["a"][1] - before["a"][1] < PAYLOAD // 10  # only acks came back


def test_the_rate_is_in_force_on_both_ends(bed: Testbed) -> None:
    h = bed.host("a", rate="1gbit")
    assert "tbf" in h.qdisc() and "rate 1Gbit" in h.qdisc()
    port = bed.run_in_parent("tc", "qdisc", "show", "dev", h.port)
    assert "rate 1Gbit" in port
    h.shape(rate="100mbit")
    assert "rate 100Mbit" in h.qdisc()
    h.shape()
    assert "tbf" not in h.qdisc()


def _listen(addr: str, port: int = 9100) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    return s


def _min_connect_s(addr: str, port: int = 9100, tries: int = 5) -> float:
    """The shortest of a few TCP handshakes to addr: one round trip each (SYN, SYN-ACK)."""
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        with socket.create_connection((addr, port), timeout=10):
            best = min(best, time.perf_counter() - t)
    return best


def test_delay_is_in_force_each_way_and_follows_shape(bed: Testbed) -> None:
    """A host's delay holds what it sends and what it receives: a round trip to an undelayed
    host crosses its link twice. Lower bounds only: a packet cannot beat its delay."""
    a, b = bed.host("a", rate="1gbit", delay="10ms"), bed.host("b", rate="1gbit")
    listener = b.call(_listen, b.addr)
    try:
        assert a.call(_min_connect_s, b.addr) >= 0.020
        assert "NFQUEUE" in a.faults() and "rate 1Gbit" in a.qdisc()
        a.shape(rate="1gbit", delay="25ms")
        b.shape(delay="5ms")  # a packet between them crosses both links
        assert a.call(_min_connect_s, b.addr) >= 2 * (0.025 + 0.005)
        a.shape()
        assert a.faults() == "" and "tbf" not in a.qdisc()
    finally:
        listener.close()


def _udp_burst(addr: str, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(count):
            s.sendto(i.to_bytes(4, "big") * 64, (addr, 9200))  # never refused: lost on the wire
            if i % 50 == 49:
                time.sleep(0.005)  # the receiver's buffer must not be what drops them


def _udp_sink(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root, as the bed)
    s.bind((addr, 9200))
    return s


def _received(sink: socket.socket) -> int:
    sink.settimeout(1.0)
    n = 0
    with contextlib.suppress(TimeoutError):
        while sink.recv(4096):
            n += 1
    return n


@pytest.mark.parametrize("lossy", ["sender", "receiver"])
def test_loss_drops_on_the_wire_and_counts(bed: Testbed, lossy: str) -> None:
    """Loss is real packet loss on the bridge in either direction of the lossy host's link:
    the sender's sendto succeeds, the receiver misses exactly what the rules counted."""
    a, b = bed.host("a"), bed.host("b")
    sink = b.call(_udp_sink, b.addr)
    sent = 600
    try:
        a.call(_udp_burst, b.addr, 1)  # a's neighbour entry for b: no burst waits on ARP
        assert _received(sink) == 1
        (a if lossy == "sender" else b).shape(loss="10%")
        a.call(_udp_burst, b.addr, sent)
        got = _received(sink)
    finally:
        sink.close()
    dropped = a.dropped() + b.dropped()
    assert dropped > 0 and got + dropped == sent, (got, dropped)


def test_tcp_crosses_loss_and_delay_whole(bed: Testbed, tmp_path: Path) -> None:
    """What the e2e test relies on: TCP over a lossy, delayed link delivers every byte."""
    a, b = bed.host("a", rate="1gbit", delay="5ms", loss="5%"), bed.host("b", rate="1gbit")
    log = tmp_path / "sink.log"
    b.spawn([sys.executable, "-c", SINK, b.addr], env=dict(os.environ), log=log)
    _wait_listening(log)
    assert a.call(_send, b.addr, PAYLOAD, timeout=60) == PAYLOAD
    assert a.dropped() > 0


def test_bad_faults_are_refused_before_any_change(bed: Testbed) -> None:
    h = bed.host("a", rate="100mbit")
    with pytest.raises(ValueError, match="delay '10 parsecs'"):
        h.shape(rate="1gbit", delay="10 parsecs")
    with pytest.raises(ValueError, match="loss '1'"):
        h.shape(loss="1")
    assert "rate 100Mbit" in h.qdisc() and h.faults() == ""
    assert parse_delay("1.5ms") == 1500 and parse_delay("1s") == 1_000_000
    assert parse_loss("0.5%") == 0.005 and parse_loss(None) == 0.0


def test_without_iptables_faults_fail_by_name(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without iptables (the bed's loss and delay rules) gets a message naming it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("unshare", "nsenter", "ip", "tc", "sh", "sleep", "mount", "mkdir", "echo"):
        if (path := shutil.which(tool)) is not None:
            (bin_dir / tool).symlink_to(path)
    monkeypatch.setenv("PATH", str(bin_dir))
    with Testbed() as b:
        b.host("a", rate="1gbit")  # rates need no iptables
        with pytest.raises(TestbedUnavailable, match="need `iptables`"):
            b.host("b", delay="10ms")


def test_a_partition_fails_connects_and_heals(bed: Testbed, tmp_path: Path) -> None:
    a, b = bed.host("a"), bed.host("b")
    log = tmp_path / "sink.log"
    proc = b.spawn([sys.executable, "-c", SINK, b.addr], env=dict(os.environ), log=log)
    _wait_listening(log)
    assert a.call(_send, b.addr, 1000) == 1000
    b.set_link(up=False)
    # From the partitioned host: no route at all, at once.
    with pytest.raises(OSError):
        b.call(socket.create_connection, (a.addr, 22), timeout=1)
    # From the other side: nothing answers (the attempt ends within its timeout).
    with pytest.raises(OSError):
        a.call(_send, b.addr, 1000, timeout=1)
    assert proc.poll() is None  # the host's processes live on
    b.set_link(up=True)
    assert a.call(_send, b.addr, 1000) == 1000


def test_the_bed_cleans_up(tmp_path: Path) -> None:
    with Testbed() as bed:
        h = bed.host("a")
        log = tmp_path / "sink.log"
        proc = h.spawn([sys.executable, "-c", SINK, h.addr], env=dict(os.environ), log=log)
        _wait_listening(log)
        holder = bed.holder_pid
    assert proc.poll() is not None
    assert not Path(f"/proc/{holder}").exists()
