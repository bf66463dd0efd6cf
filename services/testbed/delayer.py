"""The test bed's link delay: a userspace NFQUEUE delayer (`-m mooncake_k8s.testbed.delayer`).

Why: some kernels (this project's dev VMs) have no netem qdisc and no fq, so nothing in the
kernel can hold a packet for a while. Netfilter's queue can: the bed's holder sends every bridged
IPv4 packet of a delayed host to queue 0 (iptables `-j NFQUEUE`, br_netfilter), and this process,
running in the holder's network namespace, gives each packet its ACCEPT verdict once its delay
has passed. A packet's delay is its sender's link delay plus its receiver's (the delay is a
property of each host's link, crossed once going out and once coming in, as netem on both ends
of the link would do). One process serves every host of the bed.

Talks netfilter's netlink protocol (NETLINK_NETFILTER, subsystem NFNL_SUBSYS_QUEUE) directly:
only the first 20 bytes of each packet (its IPv4 header: who sent it, to whom) are copied up.
Large GSO packets stay whole (NFQA_CFG_F_GSO). Delays are set on stdin, one line per host:
`ADDR MICROSECONDS` (0 = none); each line is answered `ok` once in force.
"""

from __future__ import annotations

import heapq
import os
import selectors
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
_QUEUE = 3 << 8  # NFNL_SUBSYS_QUEUE, the message types' high byte
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = _QUEUE | 0, _QUEUE | 1, _QUEUE | 2
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_PACKET = 2
F_GSO = 4
ATTR_PACKET_HDR, ATTR_PAYLOAD, ATTR_VERDICT_HDR = 1, 10, 2
NF_ACCEPT = 1
#: How many packets the kernel may hold for us; beyond that it drops (a full router buffer).
QUEUE_MAXLEN = 16384
_NLMSG = struct.Struct("=IHHII")


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return _NLMSG.pack(_NLMSG.size + len(body), kind, flags, seq, 0) + body


def verdict(queue: int, packet_id: int) -> bytes:
    """The netlink message that lets packet `packet_id` of `queue` go on."""
    return _message(MSG_VERDICT, NLM_F_REQUEST, queue,
                    _attr(ATTR_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id)))


def parse_packets(buf: bytes) -> list[tuple[int, bytes, bytes]]:
    """Every queued packet in one read of the socket: (id, source, destination) with the
    addresses as 4 raw bytes. Raises OSError for an error message from the kernel."""
    out = []
    off = 0
    while off + _NLMSG.size <= len(buf):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(buf, off)
        if length < _NLMSG.size:
            break
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", buf, off + _NLMSG.size)
            if err:
                raise OSError(-err, f"nfqueue: {os.strerror(-err)}")
        elif kind == MSG_PACKET:
            attrs = _attrs(buf[off + _NLMSG.size + 4:off + length])
            header, payload = attrs.get(ATTR_PACKET_HDR), attrs.get(ATTR_PAYLOAD, b"")
            if header is not None:
                (pid,) = struct.unpack_from(">I", header)
                out.append((pid, payload[12:16], payload[16:20]))
        off += (length + 3) & ~3
    return out


def _attrs(buf: bytes) -> dict[int, bytes]:
    out = {}
    off = 0
    while off + 4 <= len(buf):
        length, kind = struct.unpack_from("=HH", buf, off)
        if length < 4:
            break
        out[kind & 0x3FFF] = buf[off + 4:off + length]
        off += (length + 3) & ~3
    return out


def open_queue(queue: int) -> socket.socket:
    """Bind netfilter queue `queue` of this network namespace, copying 20 bytes a packet."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    s.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE: never lose a packet's news
    s.bind((0, 0))
    bind = struct.pack(">BBH", CMD_BIND, 0, socket.AF_INET)
    params = (_attr(CFG_PARAMS, struct.pack(">IB", 20, COPY_PACKET))
              + _attr(CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN))
              + _attr(CFG_MASK, struct.pack(">I", F_GSO))
              + _attr(CFG_FLAGS, struct.pack(">I", F_GSO)))
    for seq, attrs in enumerate((_attr(CFG_CMD, bind), params), start=1):
        s.send(_message(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, queue, attrs, seq))
        parse_packets(s.recv(65536))  # the ack; an error raises
    return s


class Delayer:
    """Holds each queued packet for its hosts' delays, then accepts it (in release order)."""

    def __init__(self, queue: int = 0) -> None:
        self.queue = queue
        self.sock = open_queue(queue)
        self.delays: dict[bytes, float] = {}
        self.held: list[tuple[float, int, int]] = []
        self._seq = 0

    def set_delay(self, addr: str, micros: int) -> None:
        key = socket.inet_aton(addr)
        if micros > 0:
            self.delays[key] = micros / 1e6
        else:
            self.delays.pop(key, None)

    def receive(self) -> None:
        try:
            buf = self.sock.recv(1 << 20)
        except OSError as e:  # ENOBUFS: news of some packets lost; they stay held by the kernel
            print(f"delayer: {e}", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        for pid, src, dst in parse_packets(buf):
            due = now + self.delays.get(src, 0.0) + self.delays.get(dst, 0.0)
            self._seq += 1
            heapq.heappush(self.held, (due, self._seq, pid))

    def release(self) -> float | None:
        """Accept every packet that is due; seconds until the next one (None: none held)."""
        now = time.monotonic()
        out = []
        while self.held and self.held[0][0] <= now:
            out.append(verdict(self.queue, heapq.heappop(self.held)[2]))
        if out:
            self.sock.send(b"".join(out))
        return max(0.0, self.held[0][0] - now) if self.held else None


def serve(queue: int = 0) -> None:
    """Run until stdin closes (the bed is gone)."""
    d = Delayer(queue)
    sel = selectors.DefaultSelector()
    sel.register(d.sock, selectors.EVENT_READ, "net")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "ctl")
    print("ready", flush=True)
    lines = b""
    while True:
        for key, _ in sel.select(d.release()):
            if key.data == "net":
                d.receive()
                continue
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                return
            lines += chunk
            while b"\n" in lines:
                line, lines = lines.split(b"\n", 1)
                addr, micros = line.decode().split()
                d.set_delay(addr, int(micros))
                print("ok", flush=True)


if __name__ == "__main__":
    try:
        serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    except OSError as e:
        print(f"delayer: cannot serve netfilter queue: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
