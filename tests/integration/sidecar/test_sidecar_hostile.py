"""The sidecar's socket under broken and hostile clients: every bad frame gets a typed answer
(or the connection is closed), and the sidecar keeps serving everyone else."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.sidecar import protocol as p
from mooncake_k8s.sidecar.client import KEYS_PER_REQUEST, SidecarPagePool
from mooncake_k8s.sidecar.testing import Pages, SidecarProc, page_bytes

pytestmark = pytest.mark.timeout(120)
TOKEN = "test-token"  # conftest's cluster token
Spawn = Callable[..., SidecarProc]
PAGE = 60 * 64


@pytest.fixture
def sidecar(spawn_sidecar: Spawn) -> Iterator[SidecarProc]:
    yield spawn_sidecar()


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_raw() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _OPEN.append(s)
    s.settimeout(10)
    s.connect(path)
    return s


def call(s: socket.socket, op: int, body: dict[str, object]) -> tuple[p.Status, dict[str, object]]:
    s.sendall(p.encode(p.Kind.REQUEST, op, body))
    return reply(s)


def reply(s: socket.socket) -> tuple[p.Status, dict[str, object]]:
    kind, code, data = p.read_frame(s)
    assert kind == p.Kind.RESPONSE
    return p.Status(code), p.decode_body(data)


def hello(s: socket.socket) -> dict[str, object]:
    status, body = call(s, p.Op.HELLO, {"token": TOKEN})
    assert status == p.Status.OK, body
    return body


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def still_serves(sc: SidecarProc) -> None:
    """A well-behaved client still round-trips a page, byte-exact."""
    src, dst = Pages(1, PAGE), Pages(1, PAGE, fill=0)
    src.fill_from(77, 0)
    with SidecarPagePool(sc.socket, TOKEN) as pool:
        assert pool.put_pages(["hostile-ok"], src.all()) == [True]
        assert pool.get_pages(["hostile-ok"], dst.all()) == [True]
    assert np.array_equal(dst.content(0), page_bytes(77, 0, PAGE))


@pytest.mark.parametrize("frame", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our magic
    p.HEADER.pack(p.MAGIC, p.VERSION, p.Kind.REQUEST, p.Op.HELLO, 1 << 31),  # oversized
    p.HEADER.pack(p.MAGIC, p.VERSION + 7, p.Kind.REQUEST, p.Op.HELLO, 2) + b"{}",  # version
    p.HEADER.pack(p.MAGIC, p.VERSION, 9, p.Op.HELLO, 2) + b"{}",  # kind
    p.HEADER.pack(p.MAGIC, p.VERSION, p.Kind.RESPONSE, 0, 2) + b"{}",  # a response, as request
])
def test_bad_frames_get_bad_frame_and_are_closed(sidecar: SidecarProc, frame: bytes) -> None:
    s = raw(sidecar.socket)
    s.sendall(frame)
    status, body = reply(s)
    assert status == p.Status.BAD_FRAME and body["message"]
    assert closed(s)
    still_serves(sidecar)


def test_requests_before_hello_or_with_a_wrong_token(sidecar: SidecarProc) -> None:
    s = raw(sidecar.socket)
    assert call(s, p.Op.GET, {"keys": ["k"], "spans": [[0, 1]]})[0] == p.Status.NEED_HELLO
    assert closed(s)
    s = raw(sidecar.socket)
    assert call(s, p.Op.HELLO, {"token": "wrong"})[0] == p.Status.UNAUTHENTICATED
    assert closed(s)
    s = raw(sidecar.socket)
    assert call(s, p.Op.HELLO, {})[0] == p.Status.UNAUTHENTICATED
    still_serves(sidecar)


def test_bad_requests_keep_the_connection(sidecar: SidecarProc) -> None:
    s = raw(sidecar.socket)
    slot = hello(s)["slot"]
    assert isinstance(slot, dict)
    size = int(slot["size"])
    bad: list[tuple[int, bytes]] = [  # (op code, body bytes)
        (p.Op.GET, b"\xff\xfe not json"),
        (p.Op.GET, b"[1, 2]"),
        (99, b"{}"),
        (p.Op.HELLO, b'{"token": "test-token"}'),  # hello twice
    ]
    bodies: list[dict[str, object]] = [
        {"keys": "k", "spans": [[0, 1]]},
        {"keys": [""], "spans": [[0, 1]]},
        {"keys": ["k" * 2000], "spans": [[0, 1]]},
        {"keys": ["k"], "spans": [[size - 10, 100]]},  # runs past the slot
        {"keys": ["k"], "spans": [[-1, 10]]},
        {"keys": ["k"], "spans": [[0, 0]]},
        {"keys": ["k"], "spans": [[0, 1], [1, 1]]},
        {"keys": ["k"], "spans": [["0", 1]]},
        {"keys": ["k"], "spans": [[True, 1]]},
        {"keys": ["k"] * (p.MAX_KEYS + 1), "spans": [[0, 1]] * (p.MAX_KEYS + 1)},
    ]
    for op in (p.Op.GET, p.Op.PUT):
        bad += [(op, p.encode(p.Kind.REQUEST, op, b)[p.HEADER.size:]) for b in bodies]
    for code, data in bad:
        s.sendall(p.HEADER.pack(p.MAGIC, p.VERSION, p.Kind.REQUEST, code, len(data)) + data)
        status, body = reply(s)
        assert status == p.Status.BAD_REQUEST, (code, data[:80], body)
    status, stats = call(s, p.Op.STATS, {})  # the same connection still works
    assert status == p.Status.OK
    assert int(str(stats["errors_bad_request"])) >= len(bad)
    status, body = call(s, p.Op.PREFIX_EXISTS, {"keys": ["nope"]})
    assert (status, body) == (p.Status.OK, {"n": 0})


def test_silent_and_stalled_clients_are_cut_off(sidecar: SidecarProc) -> None:
    silent = [raw(sidecar.socket) for _ in range(20)]  # more than the 4 slots
    half = raw(sidecar.socket)
    half.sendall(p.HEADER.pack(p.MAGIC, p.VERSION, p.Kind.REQUEST, p.Op.HELLO, 100)[:5])
    still_serves(sidecar)  # none of them holds a slot or blocks anyone
    t0 = time.monotonic()
    assert all(closed(s) for s in [*silent, half])  # hello timeout: 2 s
    assert time.monotonic() - t0 < 8


def test_slots_run_out_and_come_back(sidecar: SidecarProc) -> None:
    held = [raw(sidecar.socket) for _ in range(4)]
    offsets = set()
    for s in held:
        slot = hello(s)["slot"]
        assert isinstance(slot, dict)
        offsets.add(slot["offset"])
    assert len(offsets) == 4  # each connection its own slot
    extra = raw(sidecar.socket)
    assert call(extra, p.Op.HELLO, {"token": TOKEN})[0] == p.Status.NO_SLOT
    assert closed(extra)
    t0 = time.monotonic()
    with SidecarPagePool(sidecar.socket, TOKEN) as pool:  # no slot: a quick miss, no raise
        assert pool.get_pages(["x"], Pages(1, PAGE).all()) == [False]
        assert pool.prefix_exists(["x"]) == 0
    assert time.monotonic() - t0 < 1
    held.pop().close()
    deadline = time.monotonic() + 5
    while True:
        try:
            still_serves(sidecar)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_client_side_bad_input_is_typed(sidecar: SidecarProc) -> None:
    page = Pages(1, PAGE).all()
    cases: list[tuple[list[str], list[list[tuple[int, int]]]]] = [
        (["a", "b"], page), (["k" * 2000], page), ([""], page), (["a"], [[(0, 10)]]), (["a"], [[]]),
    ]
    with SidecarPagePool(sidecar.socket, TOKEN) as pool:
        for keys, pages in cases:
            for call_ in (pool.put_pages, pool.get_pages):
                with pytest.raises(InvalidArgument):
                    call_(keys, pages)
        with pytest.raises(InvalidArgument):
            pool.prefix_exists("abc")
        with pytest.raises(InvalidArgument):
            pool.prefix_exists(["k" * 2000])


def test_batches_above_the_request_key_limit_are_split(sidecar: SidecarProc) -> None:
    n = 2 * KEYS_PER_REQUEST + 50
    pages = Pages(n, 60)
    for i in range(n):
        pages.fill_from(5, i)
    keys = [f"many-{i}" for i in range(n)]
    with SidecarPagePool(sidecar.socket, TOKEN) as pool:
        assert pool.put_pages(keys, pages.all()) == [True] * n
        assert pool.prefix_exists(keys) == n
        assert pool.prefix_exists([*keys, "many-missing"]) == n
        dst = Pages(n, 60, fill=0)
        assert pool.get_pages(keys, dst.all()) == [True] * n
    assert all(np.array_equal(dst.content(i), page_bytes(5, i, 60)) for i in range(n))
