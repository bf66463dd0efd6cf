"""The RDMA connect frame: the request and response framing and the endpoint payload, as
documented in `frames`, including what a hostile or buggy peer may send."""

from __future__ import annotations

import pytest

from mooncake_k8s.common.errors import ProtocolError
from mooncake_k8s.transfer import frames as fr

GID = bytes.fromhex("00000000000000000000ffff0a000001")


def server_endpoint() -> fr.RdmaEndpoint:
    return fr.RdmaEndpoint(
        qp_num=0x12345, psn=0xABCDEF, lid=7, gid=GID, mtu=5, rd_atomic=16,
        max_message=1 << 30,
        regions=(fr.RdmaRegion("node-a-dram", 0x7F00_0000_0000, 0xDEADBEEF, 1 << 34),
                 fr.RdmaRegion("regions", 0x5555_0000, 1, 64_016)))


def test_endpoint_round_trips_with_its_regions() -> None:
    ep = server_endpoint()
    raw = fr.encode_rdma_endpoint(ep)
    assert len(raw) == (fr.RDMA_ENDPOINT.size + 2 * fr.RDMA_REGION.size
                        + len("node-a-dram") + len("regions"))
    assert raw[:4] == b"MCRD"
    assert fr.decode_rdma_endpoint(raw) == ep
    client = fr.RdmaEndpoint(1, 2, 0, bytes(16), 3, 1, 1 << 31)
    assert fr.decode_rdma_endpoint(fr.encode_rdma_endpoint(client)) == client


def test_connect_request_and_response_frames_round_trip() -> None:
    body = fr.encode_rdma_endpoint(server_endpoint())
    req = fr.encode_request(fr.OP_RDMA_CONNECT, fr.RDMA_CONNECT_NAME, 9, 0, len(body)) + body
    parsed, used = fr.decode_request(req)
    assert used == len(req)
    assert (parsed.op, parsed.name, parsed.req_id, parsed.payload) == (
        fr.OP_RDMA_CONNECT, "rdma", 9, body)
    resp = fr.encode_response(fr.ST_OK, 9, len(body)) + body
    r, used = fr.decode_response(resp, fr.OP_RDMA_CONNECT)
    assert used == len(resp) and fr.decode_rdma_endpoint(r.payload) == server_endpoint()
    err = fr.encode_error(fr.ST_UNSUPPORTED, 9, "RDMA unavailable at the peer: no devices")
    r, _ = fr.decode_response(err, fr.OP_RDMA_CONNECT)
    assert r.status == fr.ST_UNSUPPORTED and "no devices" in r.message


def test_connect_request_longer_than_an_endpoint_may_be_is_a_protocol_error() -> None:
    head = fr.encode_request(fr.OP_RDMA_CONNECT, fr.RDMA_CONNECT_NAME, 1, 0,
                             fr.MAX_RDMA_ENDPOINT + 1)
    with pytest.raises(ProtocolError, match="RDMA endpoint of"):
        fr.decode_request_header(head)


_NAME_AT = fr.RDMA_ENDPOINT.size + fr.RDMA_REGION.size


def _good() -> bytes:
    return fr.encode_rdma_endpoint(server_endpoint())


@pytest.mark.parametrize(("mutate", "words"), [
    (lambda b: b[:10], "truncated RDMA endpoint"),
    (lambda b: b"XXXX" + b[4:], "bad RDMA endpoint magic"),
    (lambda b: b[:4] + b"\x09" + b[5:], "unsupported RDMA endpoint version 9"),
    (lambda b: b[:5] + b"\x00" + b[6:], "mtu code 0"),
    (lambda b: b[:5] + b"\x06" + b[6:], "mtu code 6"),
    (lambda b: b[:12] + b"\x01\x00\x00\x00" + b[16:], "over 24 bits"),  # qp_num 2**24
    (lambda b: b[:10] + b"\xff\xff" + b[12:], "RDMA regions, over limit"),
    (lambda b: b[:-3], "truncated RDMA region name"),
    (lambda b: b[: fr.RDMA_ENDPOINT.size + 5], "truncated RDMA region"),
    (lambda b: b + b"\x00", "trailing bytes"),
    (lambda b: b[:_NAME_AT] + b"/" + b[_NAME_AT + 1:], "invalid segment name"),
])
def test_malformed_endpoints_are_protocol_errors(mutate: object, words: str) -> None:
    bad = mutate(_good())  # type: ignore[operator]
    with pytest.raises(ProtocolError, match=words):
        fr.decode_rdma_endpoint(bad)


def test_region_wrapping_the_address_space_is_refused() -> None:
    raw = fr.encode_rdma_endpoint(fr.RdmaEndpoint(
        1, 1, 1, GID, 3, 1, 1, (fr.RdmaRegion("x", 2**64 - 10, 1, 10),)))
    assert fr.decode_rdma_endpoint(raw).regions[0].addr == 2**64 - 10  # ends exactly at 2**64
    raw = fr.encode_rdma_endpoint(fr.RdmaEndpoint(
        1, 1, 1, GID, 3, 1, 1, (fr.RdmaRegion("x", 2**64 - 10, 1, 11),)))
    with pytest.raises(ProtocolError, match="wraps"):
        fr.decode_rdma_endpoint(raw)


@pytest.mark.parametrize("bad", [
    {"qp_num": 1 << 24}, {"psn": -1}, {"gid": b"short"}, {"mtu": 0}, {"rd_atomic": 256},
])
def test_encoding_refuses_fields_outside_the_wire_ranges(bad: dict[str, object]) -> None:
    fields = {"qp_num": 1, "psn": 1, "lid": 1, "gid": GID, "mtu": 3, "rd_atomic": 1,
              "max_message": 1} | bad
    with pytest.raises(ValueError):
        fr.encode_rdma_endpoint(fr.RdmaEndpoint(**fields))  # type: ignore[arg-type]
