"""The one mapping of domain errors to HTTP (conductor/http/errors.py)."""

from __future__ import annotations

import pytest

from mooncake_k8s.conductor.http.errors import DOMAIN_ERRORS, api_error
from mooncake_k8s.conductor.http.protocol import ApiError
from mooncake_k8s.conductor.serving import errors as se


def _subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


@pytest.mark.parametrize("cls, status, type_, code", [
    (se.NoCapacity, 503, "server_error", "no_capacity"),
    (se.UpstreamFailed, 503, "server_error", "upstream_failed"),
    (se.DecodeFailed, 503, "server_error", "decode_failed"),
    (se.NothingToResume, 502, "server_error", "decode_failed"),
    (se.WorkerFailed, 502, "server_error", None),
    (se.WorkerRefused, 400, "invalid_request_error", None),
])
def test_each_serving_error_has_its_answer(cls: type[se.ServingError], status: int, type_: str,
                                           code: str | None) -> None:
    e = api_error(cls("what went wrong"))
    assert (e.status, e.type, e.code) == (status, type_, code)
    assert e.body()["error"]["message"] == "what went wrong"


def test_no_known_domain_error_falls_through_to_a_500() -> None:
    known = set().union(*(_subclasses(c) for c in DOMAIN_ERRORS))
    assert len(known) >= 6
    for cls in known:  # the catch-all would answer "internal server error"
        assert api_error(cls("x")).message == "x", cls


def test_anything_else_is_an_opaque_500_and_an_api_error_is_itself() -> None:
    e = api_error(RuntimeError("secret internals"))
    assert e.status == 500 and "secret" not in e.message
    mine = ApiError(404, "nope", code="model_not_found")
    assert api_error(mine) is mine
