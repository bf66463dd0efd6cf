"""Starting a token-checked gRPC server on exactly the address given (master and workers)."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc

from mooncake_k8s.common.auth import TokenInterceptor

MAX_MESSAGE = 64 << 20


def start_server(
    name: str, host: str, port: int, token: str, workers: int, handler: Any
) -> tuple[grpc.Server, int]:
    """A started server and its bound port. SO_REUSEPORT is off so a second process can never
    silently share a port that is already taken; a bind failure is an OSError naming it."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name),
        interceptors=[TokenInterceptor(token)],
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE),
                 ("grpc.max_send_message_length", MAX_MESSAGE)],
    )
    server.add_generic_rpc_handlers((handler,))
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError as e:
        raise OSError(f"cannot bind the {name} server to {target}: {e}") from e
    if not bound:
        raise OSError(f"cannot bind the {name} server to {target}")
    server.start()
    return server, bound
