"""Loss and delay on the test bed's links, without netem.

Why not netem: some kernels (this project's dev VMs, 6.18-fc) are built without it and without
fq, so no qdisc can hold or drop packets at random. Netfilter can, on the bridge: the holder
passes every bridged IPv4 packet through its own iptables (br_netfilter,
`bridge-nf-call-iptables`), where
- loss is a kernel rule per direction of a host's link: `-s HOST -m statistic --mode random
  --probability P -j DROP` (what the host sends) and the same with `-d HOST` (what it receives).
  The packet is lost on the wire, after its sender let it go, as on a real lossy link;
- delay sends the host's packets to netfilter queue 0, where `delayer.py` (one process in the
  holder's network namespace) accepts each one after its sender's plus its receiver's delay.
A packet from host A to host B thus crosses A's link and B's link, each with its own loss and
delay, as netem on both ends of every link would have it. Traffic inside a host (loopback) and
ARP are untouched. The link rate stays a tbf qdisc on both ends (bed.py). Not in each host's own
namespace: there a drop in the sender's output path is an error of its socket (EPERM), not a
loss on the wire.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_k8s.testbed.bed import Host, Testbed

_TABLE = ("iptables", "-t", "mangle")
_BR_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
_QUEUE = "0"


def parse_delay(delay: str | None) -> int:
    """`"10ms"` (also `s`, `us`, fractions) -> microseconds; None or "" -> 0."""
    if not delay:
        return 0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|ms|us)\s*", delay)
    if m is None:
        raise ValueError(f"delay {delay!r}: give a time such as '10ms', '1.5ms', '500us', '1s'")
    scale = {"s": 1_000_000, "ms": 1000, "us": 1}[m.group(2)]
    return round(float(m.group(1)) * scale)


def parse_loss(loss: str | None) -> float:
    """`"1%"` -> 0.01; None or "" -> 0."""
    if not loss:
        return 0.0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", loss)
    if m is None or float(m.group(1)) > 100:
        raise ValueError(f"loss {loss!r}: give a percentage from 0% to 100%, such as '1%'")
    return float(m.group(1)) / 100


class Faults:
    """The bed's loss and delay rules (in the holder's iptables) and its delayer process."""

    def __init__(self, bed: Testbed) -> None:
        self.bed = bed
        self.rules: dict[str, list[list[str]]] = {}
        self._delayer: subprocess.Popen[bytes] | None = None
        self._ready = False

    def apply(self, host: Host, delay: str | None, loss: str | None) -> None:
        """Replace `host`'s loss and delay by these (None: none). Validates before changing
        anything; raises `TestbedUnavailable` naming what this machine lacks."""
        micros, prob = parse_delay(delay), parse_loss(loss)
        if not micros and not prob and not self.rules.get(host.name):
            return
        self._prepare()
        for spec in self.rules.pop(host.name, []):
            self._iptables("-D", "FORWARD", *spec)
        if micros:
            self._start_delayer()
        if self._delayer is not None:
            self._set_delay(host.addr, micros)  # before its packets are queued
        rules: list[list[str]] = []
        if prob:
            for way in ("-s", "-d"):
                spec = [way, host.addr, "-m", "statistic", "--mode", "random",
                        "--probability", f"{prob:.6f}", "-j", "DROP"]
                self._iptables("-I", "FORWARD", "1", *spec)  # before any queueing
                rules.append(spec)
        if micros:
            for way in ("-s", "-d"):
                spec = [way, host.addr, "-j", "NFQUEUE", "--queue-num", _QUEUE]
                self._iptables("-A", "FORWARD", *spec)
                rules.append(spec)
        self.rules[host.name] = rules

    def describe(self, host: Host) -> str:
        """The rules in force for `host`, one per line (`iptables -S` form, with counters)."""
        out = self.bed.run_in_parent(*_TABLE, "-S", "FORWARD", "-v")
        return "\n".join(line for line in out.splitlines()
                         if f" {host.addr}/32 " in f"{line} ")

    def dropped(self, host: Host) -> int:
        """Packets the host's loss rules dropped (both directions) since they were set."""
        if not any("DROP" in spec for spec in self.rules.get(host.name, [])):
            return 0
        total = 0
        for line in self.describe(host).splitlines():
            fields = line.split()
            if fields[-1] == "DROP" and "-c" in fields:
                total += int(fields[fields.index("-c") + 1])
        return total

    def close(self) -> None:
        p, self._delayer = self._delayer, None
        if p is None:
            return
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    # -- the machinery --------------------------------------------------------------------------

    def _prepare(self) -> None:
        from mooncake_k8s.testbed.bed import TestbedUnavailable

        if self._ready:
            return
        if shutil.which("iptables") is None:
            raise TestbedUnavailable(
                "delay and loss on the test bed's links need `iptables` on PATH (Debian/Ubuntu "
                "package iptables; scripts/setup.sh installs it): they are netfilter rules on the "
                "bed's bridge, not netem, which this kernel may lack")
        try:
            self.bed.run_in_parent("sh", "-c", f"echo 1 > {_BR_NF}")
        except TestbedUnavailable as e:
            raise TestbedUnavailable(
                "delay and loss on the test bed's links need bridged packets to pass iptables: "
                f"the kernel's br_netfilter (CONFIG_BRIDGE_NETFILTER) and {_BR_NF} ({e})") from e
        self._ready = True

    def _iptables(self, *args: str) -> None:
        from mooncake_k8s.testbed.bed import TestbedUnavailable

        try:
            self.bed.run_in_parent(*_TABLE, *args)
        except TestbedUnavailable as e:
            raise TestbedUnavailable(
                f"{e}: loss needs the kernel's statistic match "
                "(CONFIG_NETFILTER_XT_MATCH_STATISTIC) and delay its NFQUEUE target "
                "(CONFIG_NETFILTER_XT_TARGET_NFQUEUE, CONFIG_NETFILTER_NETLINK_QUEUE)") from e

    def _start_delayer(self) -> None:
        from mooncake_k8s.testbed.bed import TestbedUnavailable

        if self._delayer is not None:
            if self._delayer.poll() is None:
                return
            raise TestbedUnavailable(f"the bed's delayer exited: {self._stderr()}")
        self._delayer = subprocess.Popen(
            [*self.bed.parent_prefix(), sys.executable, "-m", "mooncake_k8s.testbed.delayer",
             _QUEUE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        if self._line() != "ready":
            raise TestbedUnavailable(
                "the bed's delayer could not serve netfilter queue 0 (needs "
                f"CONFIG_NETFILTER_NETLINK_QUEUE): {self._stderr()}")

    def _set_delay(self, addr: str, micros: int) -> None:
        from mooncake_k8s.testbed.bed import TestbedUnavailable

        assert self._delayer is not None and self._delayer.stdin is not None
        self._delayer.stdin.write(f"{addr} {micros}\n".encode())
        self._delayer.stdin.flush()
        if self._line() != "ok":
            raise TestbedUnavailable(f"the bed's delayer did not take a delay: {self._stderr()}")

    def _line(self, timeout: float = 30.0) -> str:
        """The delayer's next line on stdout ("" if it exits or stays silent)."""
        assert self._delayer is not None and self._delayer.stdout is not None
        out: IO[bytes] = self._delayer.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        return out.readline().decode().strip() if ready else ""

    def _stderr(self) -> str:
        p = self._delayer
        if p is None or p.stderr is None:
            return "no delayer"
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=2)
        if p.poll() is None:
            return "the delayer is silent (still running)"
        return p.stderr.read().decode(errors="replace").strip() or f"exit {p.returncode}"
