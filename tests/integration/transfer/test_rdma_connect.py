"""The RDMA connect exchange against a real transfer server on 127.0.0.1, over real sockets.

Only an authenticated connection may ask for an RDMA queue pair (and so learn any rkey): a
connect sent before the hello, or after a hello with a wrong token, gets no answer but a
closed connection. An authenticated one gets an answer; on machines without an RDMA device
(every machine this suite has run on) that answer is ST_UNSUPPORTED with the server's reason,
and the connection keeps serving. The queue-pair path itself needs hardware and is not
exercised here.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from mooncake_k8s.common.errors import AuthError, TransferError
from mooncake_k8s.common.netutil import split_address
from mooncake_k8s.transfer import Peer, ReadOp, Segment, TcpTransport, TransferServer
from mooncake_k8s.transfer import frames as fr
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import TransferRejected
from mooncake_k8s.transfer.rdma import detect_rdma

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"
CLIENT = fr.RdmaEndpoint(qp_num=0x42, psn=0x1234, lid=0, gid=bytes(16), mtu=3, rd_atomic=4,
                         max_message=1 << 30)


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create_shm(f"rdma-connect-{id(object()):x}", 64 << 10, replace=True)
    seg.buf[:5] = b"hello"
    try:
        yield seg
    finally:
        seg.close()


@pytest.fixture
def server(segment: Segment) -> Iterator[TransferServer]:
    with TransferServer({segment.desc.name: segment}, token=TOKEN) as srv:
        yield srv


def connect(srv: TransferServer) -> socket.socket:
    host, port = split_address(srv.address)
    s = socket.create_connection((host, port), timeout=5)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def recv_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (raises on a 5 s silence). A server that
    closes with our bytes unread resets the connection: that is a close too."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def connect_frame(rid: int = 1) -> bytes:
    body = fr.encode_rdma_endpoint(CLIENT)
    return fr.encode_request(fr.OP_RDMA_CONNECT, fr.RDMA_CONNECT_NAME, rid, 0, len(body)) + body


def read_error(s: socket.socket) -> fr.Response:
    head = recv_exact(s, fr.RESPONSE.size)
    _st, _rid, mlen = fr.decode_response_header(head)
    resp, _ = fr.decode_response(head + recv_exact(s, mlen), fr.OP_RDMA_CONNECT)
    return resp


def test_authenticated_connect_is_answered_with_the_servers_reason(
        server: TransferServer) -> None:
    found = detect_rdma()
    if found.available:
        pytest.skip(f"this machine has RDMA ({found.reason}): the answer would be a QP")
    t = TcpTransport(server.address, TOKEN)
    try:
        with pytest.raises(TransferRejected) as e:
            t.exchange_rdma(fr.encode_rdma_endpoint(CLIENT))
        assert e.value.code == fr.ST_UNSUPPORTED
        assert "RDMA unavailable at the peer" in str(e.value) and found.reason in str(e.value)
    finally:
        t.close()


def test_connect_before_the_hello_is_never_answered(server: TransferServer) -> None:
    s = connect(server)
    try:
        s.sendall(connect_frame())
        assert recv_all(s) == b""  # bad hello magic: closed without a word
    finally:
        s.close()


def test_connect_after_a_wrong_token_is_never_answered(server: TransferServer) -> None:
    s = connect(server)
    try:
        s.sendall(fr.encode_hello("wrong-token") + connect_frame())
        got = recv_all(s)
        status, msg, used = fr.decode_hello_reply(got)
        assert status == fr.HELLO_AUTH_FAILED and "invalid cluster token" in msg
        assert got[used:] == b""  # no RESPONSE to the connect: nothing about any segment
    finally:
        s.close()
    t = TcpTransport(server.address, "wrong-token")
    try:
        with pytest.raises(AuthError):
            t.exchange_rdma(fr.encode_rdma_endpoint(CLIENT))
    finally:
        t.close()


def test_refused_connect_keeps_the_connection_and_the_request_order(
        server: TransferServer, segment: Segment) -> None:
    """Pipelined READ, connect, READ on one connection: three answers, in order."""
    name = segment.desc.name.encode()
    s = connect(server)
    try:
        s.sendall(fr.encode_hello(TOKEN))
        status, _msg, _ = fr.decode_hello_reply(recv_exact(s, fr.HELLO_REPLY.size))
        assert status == fr.HELLO_OK
        s.sendall(fr.encode_request(fr.OP_READ, name, 1, 0, 5) + connect_frame(2)
                  + fr.encode_request(fr.OP_READ, name, 3, 1, 4))
        first, _ = fr.decode_response(recv_exact(s, fr.RESPONSE.size + 5))
        assert (first.status, first.req_id, first.payload) == (fr.ST_OK, 1, b"hello")
        answer = read_error(s)
        assert answer.req_id == 2
        if detect_rdma().available:
            assert answer.status in (fr.ST_OK, fr.ST_UNSUPPORTED)
            return
        assert answer.status == fr.ST_UNSUPPORTED and "RDMA unavailable" in answer.message
        third, _ = fr.decode_response(recv_exact(s, fr.RESPONSE.size + 4))
        assert (third.status, third.req_id, third.payload) == (fr.ST_OK, 3, b"ello")
    finally:
        s.close()


@pytest.mark.parametrize(("payload", "length"), [
    (b"not an endpoint", None),  # malformed: ProtocolError closes the connection
    (b"", fr.MAX_RDMA_ENDPOINT + 1),  # longer than any endpoint may be
])
def test_malformed_connect_closes_only_that_connection(
        server: TransferServer, segment: Segment, payload: bytes, length: int | None) -> None:
    s = connect(server)
    try:
        s.sendall(fr.encode_hello(TOKEN))
        assert fr.decode_hello_reply(recv_exact(s, fr.HELLO_REPLY.size))[0] == fr.HELLO_OK
        n = len(payload) if length is None else length
        s.sendall(fr.encode_request(fr.OP_RDMA_CONNECT, fr.RDMA_CONNECT_NAME, 1, 0, n) + payload)
        assert recv_all(s) == b""
    finally:
        s.close()
    with TransferEngine(TOKEN, transport="tcp") as eng:  # the server serves everyone else
        dst = bytearray(5)
        eng.read(Peer("n", server.address, "elsewhere"), [ReadOp(segment.desc, 0, memoryview(dst))])
        assert dst == b"hello"


def test_a_server_with_rdma_disabled_says_so(segment: Segment) -> None:
    with TransferServer({segment.desc.name: segment}, token=TOKEN, rdma=False) as srv:
        t = TcpTransport(srv.address, TOKEN)
        try:
            with pytest.raises(TransferRejected, match="RDMA is disabled on this transfer "
                                                       "server") as e:
                t.exchange_rdma(fr.encode_rdma_endpoint(CLIENT))
            assert e.value.code == fr.ST_UNSUPPORTED
        finally:
            t.close()


def test_connect_to_nothing_is_a_transfer_error() -> None:
    host, port = "127.0.0.1", _closed_port()
    t = TcpTransport(f"{host}:{port}", TOKEN, io_timeout_s=2.0)
    try:
        with pytest.raises(TransferError, match="cannot connect"):
            t.exchange_rdma(fr.encode_rdma_endpoint(CLIENT))
    finally:
        t.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
