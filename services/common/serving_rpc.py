"""The serving wire contract as the generated code states it, for servers and clients alike.

`proto/serving.proto` is the contract; `rpc/serving_pb2_grpc.py` (generated, `proto/gen.py`) is
its one table of services, method paths, request and response types and streaming kinds. The
workers serve through it (`servicer_handler` over a subclass of the generated servicer) and the
Conductor calls through it (`stub`), so no method path or serializer is written by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc

ROLES = ("prefill", "decode")


class _Registrar:
    """Stands in for the `grpc.Server` a generated `add_*Servicer_to_server` registers on: it
    keeps the generic handler, which a worker hands to its server with its interceptors."""

    def __init__(self) -> None:
        self.handler: grpc.GenericRpcHandler | None = None  # type: ignore[type-arg]

    def add_generic_rpc_handlers(self, handlers: tuple[Any, ...]) -> None:
        (self.handler,) = handlers

    def add_registered_method_handlers(self, _service: str, _handlers: Any) -> None:
        """The generic handler serves registered-method calls too (the server looks a path up
        there when it has no registered handler for it)."""


def servicer_handler(add: Callable[[Any, Any], None],
                     servicer: Any) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
    """The handler the generated `add` (e.g. `add_PrefillServicer_to_server`) registers for
    `servicer`: its table maps each method to the servicer's method of that name."""
    reg = _Registrar()
    add(servicer, reg)
    if reg.handler is None:
        raise RuntimeError(f"{add.__name__} registered no handler")
    return reg.handler


def stub(role: str, channel: grpc.aio.Channel | grpc.Channel) -> Any:
    """The generated client stub of a serving role (`PrefillStub` or `DecodeStub`): one
    callable per method, e.g. `stub("prefill", ch).Prefill(request, metadata=...)`."""
    if role == "prefill":
        return pb_grpc.PrefillStub(channel)  # type: ignore[no-untyped-call]
    if role == "decode":
        return pb_grpc.DecodeStub(channel)  # type: ignore[no-untyped-call]
    raise ValueError(f"unknown serving role {role!r}; known: {', '.join(ROLES)}")
