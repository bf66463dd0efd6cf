"""Why the serving path could not answer a request: domain errors, no HTTP in them.

The pipeline and the router raise these; `conductor.http.errors` is the one place that turns
them (and the scheduler's `Overloaded`) into OpenAI-shape HTTP answers. Keeping status codes out
of the serving path lets it be driven by something other than HTTP (the simulator, a gRPC front
door) and keeps every status decision in one table.
"""

from __future__ import annotations

from mooncake_k8s.common.errors import MooncakeError


class ServingError(MooncakeError):
    """A request the serving path gave up on; the message is for the client."""


class NoCapacity(ServingError):
    """No usable instance of a role (all down, draining or still loading)."""


class UpstreamFailed(ServingError):
    """Every attempt failed on retryable worker errors."""


class WorkerFailed(ServingError):
    """A worker failed in a way that is not worth retrying elsewhere (its gRPC status says)."""


class WorkerRefused(ServingError):
    """A worker refused the request as invalid (INVALID_ARGUMENT): the client's to fix."""


class DecodeFailed(ServingError):
    """A stream the client already saw output of could not be resumed on another decode."""


class NothingToResume(ServingError):
    """The lost decode had produced everything the request asked for; the stream still broke
    before its end reached the client."""
