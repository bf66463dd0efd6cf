"""Emulated hosts on one machine: one network namespace per host on a private bridge.

Why: loopback hides what moving KV between machines costs and where it goes. Each host here has
its own address, its own link (rate, delay, loss, up or down) and its own IPC namespace, so the
transfer engine sees its peers as remote and moves KV over TCP, as between nodes.

The whole bed lives inside a private parent (`unshare --net --mount --ipc`, the "holder"), so
the machine's own interfaces, routes and mounts are never touched: the holder mounts a tmpfs on
/run for `ip netns` and owns the bridge. Every command reaches it through `nsenter -t HOLDER`;
a host's process is `nsenter ... ip netns exec HOST unshare --ipc -- ARGV` (each of those execs
the next, so the Popen's pid is the process itself, leading its own process group).

The test process stays in the machine's namespace. It talks to a host with `Host.call`: the
function runs in a new thread that has joined that host's network namespace (setns(2) changes
only the calling thread), so every socket it opens is that host's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from mooncake_k8s.testbed.faults import Faults, parse_delay, parse_loss

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_TOOLS = ("unshare", "nsenter", "ip", "tc")
_HOLDER_SETUP = ("mount -t tmpfs none /run && mkdir -p /run/netns && ip link set lo up && "
                 "ip link add br0 type bridge && ip link set br0 up && echo ready && "
                 "exec sleep infinity")


class TestbedUnavailable(RuntimeError):
    """This machine cannot build the bed (not root, or a kernel feature or tool is missing).
    Raised, never skipped: a test that needs the bed must fail where it cannot run."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass
class Host:
    """One emulated host: a network namespace with one veth on the bed's bridge."""

    bed: Testbed
    name: str
    addr: str
    index: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def dev(self) -> str:
        """The host's own end of its link (at most 15 characters, whatever the host's name)."""
        return f"h{self.index}e"

    @property
    def port(self) -> str:
        """The bridge's end of the host's link: what it sends arrives here, and the reverse."""
        return f"h{self.index}b"

    def run(self, *argv: str, check: bool = True) -> str:
        """Run a short command in this host's network namespace; its stdout."""
        return self.bed.run_in_parent("ip", "netns", "exec", self.name, *argv, check=check)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` on this host (its network and a fresh IPC namespace), leading its own
        process group; the bed kills the group on exit. Output goes to `log` (appended)."""
        cmd = [*self.bed.parent_prefix(), "ip", "netns", "exec", self.name,
               "unshare", "--ipc", "--", *argv]
        out: IO[bytes] | int = subprocess.DEVNULL
        with contextlib.ExitStack() as stack:
            if log is not None:
                out = stack.enter_context(open(log, "ab"))
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(env) if env is not None else None,
                                     start_new_session=True)
        self.procs.append(popen)
        return popen

    def shape(self, rate: str | None = None, delay: str | None = None,
              loss: str | None = None) -> None:
        """Set the link in both directions: `rate` ("1gbit", "100mbit"), `delay` ("10ms"),
        `loss` ("1%"); nothing given = unlimited. The rate is a tbf qdisc on the host's end
        (what it sends) and the bridge's end (what it receives). Delay and loss are netfilter
        rules on the bridge (faults.py: this kernel may have no netem), once per direction: a
        packet between two hosts crosses both their links, so both their delays and losses."""
        parse_delay(delay), parse_loss(loss)  # a bad value changes nothing
        self.bed.run_in_parent("tc", "qdisc", "del", "dev", self.port, "root", check=False)
        self.run("tc", "qdisc", "del", "dev", self.dev, "root", check=False)
        if rate:
            spec = ["tbf", "rate", rate, "burst", "512kb", "latency", "20ms"]
            self.run("tc", "qdisc", "add", "dev", self.dev, "root", *spec)
            self.bed.run_in_parent("tc", "qdisc", "add", "dev", self.port, "root", *spec)
        self.bed.faults.apply(self, delay, loss)

    def faults(self) -> str:
        """The loss and delay rules in force for this host (with packet counters)."""
        return self.bed.faults.describe(self)

    def dropped(self) -> int:
        """Packets its loss rules dropped, both directions, since they were last set."""
        return self.bed.faults.dropped(self)

    def qdisc(self) -> str:
        """`tc qdisc show` of the host's end of its link: the shaping actually in force."""
        return self.run("tc", "qdisc", "show", "dev", self.dev)

    def set_link(self, up: bool) -> None:
        """Down: a network partition, every process of the host still running. Up: healed
        (the address stays; the subnet's route comes back with the link)."""
        self.run("ip", "link", "set", self.dev, "up" if up else "down")

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a new thread inside this host's network namespace: a client
        (urllib, openai, a socket) that runs there connects from this host's address."""
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                _join_netns(self.bed.netns_path(self.name))
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        t = threading.Thread(target=body, name=f"testbed-{self.name}", daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]


class Testbed:
    """A private network of emulated hosts (`with Testbed() as bed: h = bed.host("a")`).

    Hosts get `SUBNET.1`, `SUBNET.2`, ... on one bridge. `counters()` reads every host's bytes
    sent and received on its link, to assert where bytes travelled. On exit every process of
    every host is killed (process groups), then the holder: its namespaces, bridge and links go
    with it."""

    __test__ = False

    def __init__(self, subnet: str = "10.77.0") -> None:
        self.subnet = subnet
        self.hosts: dict[str, Host] = {}
        self._holder: subprocess.Popen[bytes] | None = None
        self.faults = Faults(self)

    # -- the private parent -----------------------------------------------------------------

    def __enter__(self) -> Testbed:
        check_support()
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--ipc", "--propagation", "private", "--",
             "sh", "-c", _HOLDER_SETUP],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != b"ready":
            err = self._holder.stderr.read().decode(errors="replace") if self._holder.stderr \
                else ""
            self.close()
            raise TestbedUnavailable(
                "cannot build the test bed's private network (unshare --net --mount --ipc, a "
                f"tmpfs on /run, a bridge): {err.strip() or 'the holder exited'}")
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def holder_pid(self) -> int:
        if self._holder is None:
            raise RuntimeError("the test bed is not started (use it as a context manager)")
        return self._holder.pid

    def parent_prefix(self) -> list[str]:
        """The command prefix that runs a command in the holder's namespaces."""
        return ["nsenter", "-t", str(self.holder_pid), "-n", "-m", "-i", "--"]

    def run_in_parent(self, *argv: str, check: bool = True) -> str:
        r = subprocess.run([*self.parent_prefix(), *argv], capture_output=True, text=True,
                           timeout=30)
        if check and r.returncode != 0:
            raise TestbedUnavailable(f"test bed: `{' '.join(argv)}` failed "
                                     f"({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def netns_path(self, host: str) -> str:
        """The host's namespace file as seen through the holder's mount namespace."""
        return f"/proc/{self.holder_pid}/root/run/netns/{host}"

    # -- hosts --------------------------------------------------------------------------------

    def host(self, name: str, rate: str | None = None, delay: str | None = None,
             loss: str | None = None) -> Host:
        """A new host on the bridge, its link shaped as `Host.shape` says."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        h = Host(self, name, f"{self.subnet}.{index}", index)
        p = self.run_in_parent
        p("ip", "netns", "add", name)
        p("ip", "link", "add", h.dev, "type", "veth", "peer", "name", h.port)
        p("ip", "link", "set", h.dev, "netns", name)
        p("ip", "link", "set", h.port, "master", "br0")
        p("ip", "link", "set", h.port, "up")
        h.run("ip", "link", "set", "lo", "up")
        h.run("ip", "addr", "add", f"{h.addr}/24", "dev", h.dev)
        h.run("ip", "link", "set", h.dev, "up")
        self.hosts[name] = h
        if rate or delay or loss:
            h.shape(rate, delay, loss)
        return h

    def counters(self) -> dict[str, tuple[int, int]]:
        """{host: (bytes sent, bytes received)} on each host's link since it was made. Read on
        the bridge's end (the holder's /proc/PID/net/dev), where received and sent swap."""
        by_port = _net_dev(Path(f"/proc/{self.holder_pid}/net/dev").read_text())
        out = {}
        for name, h in self.hosts.items():
            rx, tx = by_port[h.port]
            out[name] = (rx, tx)
        return out

    def close(self) -> None:
        procs = [p for h in self.hosts.values() for p in h.procs]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)
            _signal_group(p, signal.SIGKILL)  # what an exited leader left in its group
        self.faults.close()
        if self._holder is not None:
            _signal_group(self._holder, signal.SIGKILL)
            self._holder.wait(timeout=10)
            for stream in (self._holder.stdout, self._holder.stderr):
                if stream is not None:
                    stream.close()


def check_support() -> None:
    """Raise `TestbedUnavailable`, saying what is missing, where the bed cannot be built."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        raise TestbedUnavailable(f"the test bed needs {', '.join(missing)} on PATH "
                                 "(util-linux and iproute2)")
    if os.geteuid() != 0:
        raise TestbedUnavailable("the test bed needs root (network namespaces, veth, a bridge "
                                 "and tc); run the tests as root, as CI does")


def _net_dev(text: str) -> dict[str, tuple[int, int]]:
    """/proc/net/dev as {interface: (received bytes, sent bytes)}."""
    out = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


def _join_netns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)
