"""The serving wire contract is the generated code's table, on both sides (`common.serving_rpc`).

A real gRPC server on loopback serves a servicer through `servicer_handler` (what the workers
do), and the generated stubs call it (what the Conductor does): no path or serializer written
by hand anywhere in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from mooncake_k8s.common import serving_rpc
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc


class _Decode(pb_grpc.DecodeServicer):
    def Decode(self, request: pb.DecodeRequest,
               context: grpc.ServicerContext) -> Iterator[pb.DecodeChunk]:
        # Echo the plan's keys back: what arrives is what was sent.
        for k in request.plan.block_keys:
            yield pb.DecodeChunk(text=k)
        yield pb.DecodeChunk(finished=True, finish_reason=request.plan.namespace)

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReport:
        return pb.LoadReport(instance_id="d0", role="decode")


def test_a_servicer_served_through_the_table_answers_the_generated_stub() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (serving_rpc.servicer_handler(pb_grpc.add_DecodeServicer_to_server, _Decode()),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = serving_rpc.stub("decode", ch)
            assert stub.Load(pb.LoadRequest(), timeout=10).instance_id == "d0"
            plan = pb.KVPlan(block_keys=["a" * 32, "b" * 32], namespace="ns", planned=True)
            chunks = list(stub.Decode(pb.DecodeRequest(request_id="r", plan=plan), timeout=10))
            assert [c.text for c in chunks[:-1]] == list(plan.block_keys)
            assert chunks[-1].finished and chunks[-1].finish_reason == "ns"
            # The other role's methods are not served here.
            with pytest.raises(grpc.RpcError) as err:
                serving_rpc.stub("prefill", ch).Prefill(pb.PrefillRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


def test_every_method_of_the_contract_is_on_the_stub() -> None:
    for role, name in (("prefill", "Prefill"), ("decode", "Decode")):
        service = pb.DESCRIPTOR.services_by_name[name]
        stub = serving_rpc.stub(role, grpc.insecure_channel("127.0.0.1:1"))
        assert {m.name for m in service.methods} == {"Load", name}
        for m in service.methods:
            assert callable(getattr(stub, m.name))


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown serving role 'conductor'"):
        serving_rpc.stub("conductor", grpc.insecure_channel("127.0.0.1:1"))
