"""OpenTelemetry tracing across conductor -> prefill -> store -> decode.

Off unless configured, and then cheap: with no exporter the SDK is not even installed as the
provider, so spans are the API's no-ops. Exporters:
- OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `--otlp-endpoint`) is set;
- JSON lines to a file when `MOONCAKE_TRACE_FILE` is set (tests and quick local debugging:
  every process appends its spans, and one trace id ties a request's spans together).
Context crosses process boundaries as W3C `traceparent` in the gRPC requests' `trace_context`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

_tracer: trace.Tracer = trace.get_tracer("mooncake_k8s")


class _JsonLinesExporter:
    """A SpanExporter that appends one JSON object per finished span to a file."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            ctx = s.get_span_context()
            parent = s.parent.span_id if s.parent is not None else None
            lines.append(json.dumps({
                "name": s.name, "service": s.resource.attributes.get("service.name"),
                "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{parent:016x}" if parent else None,
                "start_ns": s.start_time, "end_ns": s.end_time,
                "attributes": dict(s.attributes or {}),
            }))
        with self._lock, open(self._path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def setup_tracing(service: str, otlp_endpoint: str | None = None) -> bool:
    """Install a tracer provider if an exporter is configured; returns whether one is."""
    global _tracer
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    path = os.environ.get("MOONCAKE_TRACE_FILE")
    if not endpoint and not path:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
    )

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if path:
        exporter: SpanExporter = _JsonLinesExporter(path)  # type: ignore[assignment]
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("mooncake_k8s")
    return True


def inject() -> dict[str, str]:
    """The current span's context as a carrier for a downstream call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextmanager
def span(
    name: str, parent: Mapping[str, str] | None = None, **attributes: Any
) -> Iterator[trace.Span]:
    """A span, child of `parent` (a carrier from another process) when given."""
    token = None
    if parent:
        token = otel_context.attach(propagate.extract(dict(parent)))
    try:
        with _tracer.start_as_current_span(name, attributes=attributes or None) as s:
            yield s
    finally:
        if token is not None:
            otel_context.detach(token)
