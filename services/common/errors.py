"""Error types shared by every component.

Two axes, as in vLLM and kopf: *scope* (one request vs the whole peer) and *recoverability*.
Timeouts are also `TimeoutError` and connection failures also `ConnectionError`, so callers that
only know the standard library still catch them (aiohttp does the same).
"""

from __future__ import annotations


class MooncakeError(Exception):
    """Root of every error this project raises on purpose."""


class InvalidArgument(MooncakeError, ValueError):
    """The caller passed something malformed; retrying the same call cannot succeed."""


class AuthError(MooncakeError, PermissionError):
    """The cluster token was missing or wrong."""


class StoreError(MooncakeError):
    """A store operation failed."""


class ObjectNotFound(StoreError, KeyError):
    """The key is not stored, or no replica verified: a miss, never bad data."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "object not found"


class ObjectExists(StoreError):
    """A put found the key already stored; objects are immutable once published."""


class NoSpace(StoreError):
    """No segment can hold the object, even after eviction (everything left is leased or pinned)."""


class QuotaExceeded(NoSpace):
    """The put's tenant is at its quota and none of its own objects can be evicted to make
    room (or the object alone is larger than the quota); another tenant's are never evicted.
    A NoSpace: a writer that treats a full store as a miss treats this one the same way."""


class ObjectTooLarge(StoreError, InvalidArgument):
    """The object is larger than any segment or the configured object size limit."""


class BufferTooSmall(StoreError, InvalidArgument):
    """`get_into` was handed a buffer smaller than the stored object."""


class MasterUnavailable(StoreError, ConnectionError):
    """The master could not be reached; the store fails open for reads (a miss) where it can."""


class TransferError(MooncakeError, ConnectionError):
    """A transfer to or from a peer failed (peer gone, connection reset, bad frame)."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not finish within its deadline."""


class ProtocolError(TransferError):
    """The peer sent bytes that do not follow the framing; the connection is closed."""


class IntegrityError(MooncakeError):
    """Bytes failed header or checksum verification. Callers treat it as a miss."""
