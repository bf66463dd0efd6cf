"""The cluster token on internal endpoints.

gRPC calls carry it as ``authorization: Bearer <token>`` metadata; the transfer engine checks it
in its handshake. Comparison is constant-time. The token never appears in logs or errors.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

METADATA_KEY = "authorization"


def token_matches(expected: str, presented: str | bytes | None) -> bool:
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(expected.encode(), presented)


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata to pass with every gRPC call (empty when no token is configured)."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc,type-arg]
    """Rejects calls without the right bearer token with UNAUTHENTICATED.

    An empty expected token disables the check (local development only; the CLI warns).
    """

    def __init__(self, token: str) -> None:
        self._token = token

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        if not self._token:
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if (
                key == METADATA_KEY
                and isinstance(value, str)
                and value.startswith("Bearer ")
                and token_matches(self._token, value[len("Bearer ") :])
            ):
                return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
