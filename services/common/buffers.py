"""Turn caller buffers (numpy arrays, torch tensors, bytearray, memoryview) into flat byte views.

Transfers read and write through `memoryview`s so no intermediate copy is made. torch is never
imported here: a tensor is recognised by duck typing and viewed through its `.numpy()` (CPU).
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.common.errors import InvalidArgument


def byte_view(buf: Any, *, writable: bool = False) -> memoryview:
    """A contiguous, 1-D, unsigned-byte view of `buf` without copying.

    Raises InvalidArgument for non-contiguous buffers (a copy would hide a silent slowdown) and,
    when `writable`, for read-only ones.
    """
    if hasattr(buf, "numpy") and hasattr(buf, "is_contiguous") and hasattr(buf, "device"):
        if str(buf.device) != "cpu":
            raise InvalidArgument("GPU tensors must be staged through pinned host memory")
        if not buf.is_contiguous():
            raise InvalidArgument("tensor is not contiguous")
        buf = buf.detach().numpy()
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise InvalidArgument(f"object of type {type(buf).__name__} is not a buffer") from e
    if not mv.contiguous:
        raise InvalidArgument("buffer is not contiguous")
    if writable and mv.readonly:
        raise InvalidArgument("buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
