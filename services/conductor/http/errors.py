"""The one mapping of domain errors to HTTP: status, OpenAI error type and code, headers.

The serving path (`serving.errors`) and the scheduler (`sched.admission.Overloaded`) say *why*
a request failed; only this table says what a client sees for it. A new domain error without a
row here is a 500 by the middleware's catch-all, which a test rules out for every known one.
"""

from __future__ import annotations

from mooncake_k8s.conductor.http.protocol import ApiError
from mooncake_k8s.conductor.sched.admission import Overloaded
from mooncake_k8s.conductor.serving import errors as se

#: Domain error -> (HTTP status, OpenAI error type, code). Most specific class first.
_TABLE: tuple[tuple[type[Exception], int, str, str | None], ...] = (
    (se.NoCapacity, 503, "server_error", "no_capacity"),
    (se.UpstreamFailed, 503, "server_error", "upstream_failed"),
    (se.DecodeFailed, 503, "server_error", "decode_failed"),
    (se.NothingToResume, 502, "server_error", "decode_failed"),
    (se.WorkerFailed, 502, "server_error", None),
    (se.WorkerRefused, 400, "invalid_request_error", None),
)

#: The domain errors `api_error` turns into an answer by the table.
DOMAIN_ERRORS: tuple[type[Exception], ...] = (se.ServingError, Overloaded)
#: What a handler catches to answer: `ApiError` and the domain errors.
ANSWERED: tuple[type[Exception], ...] = (ApiError, *DOMAIN_ERRORS)


def api_error(e: Exception) -> ApiError:
    """The client's answer for `e`: an `ApiError` as it is, a domain error by the table, and
    anything else an opaque 500 (its details stay in the log, never in the answer)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Overloaded):
        return ApiError(429, str(e), type_="rate_limit_error", code=e.code,
                        headers={"Retry-After": str(e.retry_after_s)})
    for cls, status, type_, code in _TABLE:
        if isinstance(e, cls):
            return ApiError(status, str(e), type_=type_, code=code)
    return ApiError(500, "internal server error", type_="server_error")
