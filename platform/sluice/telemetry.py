"""OpenTelemetry, set up once per process, and the JSON log format.

Every process entry point calls `setup(service)`: the ASGI app, `rungrpc`, `runworker`
and the Celery worker. `SLUICE_TRACING` chooses what tracing costs:

    auto (default)  record and export spans when an OTLP endpoint is configured
                    (`OTEL_EXPORTER_OTLP_ENDPOINT` or `..._TRACES_ENDPOINT`, OTLP/HTTP);
                    otherwise spans are not recorded but still carry trace ids, so logs,
                    audit events and the queue's traceparent stay correlated
    on              always record (spans go to the OTLP exporter when configured; tests
                    add an in-memory exporter to `provider()`)
    off             no SDK at all: the API's no-op tracer, no trace ids

The standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` variables override the
sampler; `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` are honoured too.

Requests carry a `RequestScope` in a context variable (the adapter opens it, the
pipeline fills in tenant, model and request id); the JSON formatter adds it and the
current span's ids to every record. What is logged went through the redaction filter
first, and span attributes never hold prompts, replies, keys or personal data.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_configured: str | None = None
tracer = trace.get_tracer("sluice")  # a proxy: follows the provider set by setup()


def setup(service: str, mode: str | None = None) -> str:
    """Install the tracer provider for this process (idempotent); returns the mode."""
    global _configured
    if _configured is not None:
        return _configured
    mode = (mode or os.environ.get("SLUICE_TRACING", "auto")).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"SLUICE_TRACING must be auto, on or off, not {mode!r}")
    _configured = mode
    if mode == "off":
        return mode
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                     or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    kwargs: dict[str, Any] = {}
    if mode == "auto" and not exporting and not os.environ.get("OTEL_TRACES_SAMPLER"):
        kwargs["sampler"] = ALWAYS_OFF  # ids without the cost of recording
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service),
                                "service.namespace": "sluice"})
    provider = TracerProvider(resource=resource, **kwargs)
    if exporting:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return mode


def provider() -> Any:
    """The SDK TracerProvider this process set up (tests attach exporters to it)."""
    return trace.get_tracer_provider()


def shutdown() -> None:
    """Flush what the exporter still holds (called on a clean process exit)."""
    close = getattr(trace.get_tracer_provider(), "shutdown", None)
    if close is not None:
        close()


def traceparent() -> str:
    """The current span's W3C traceparent ("" when there is no valid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def current_context() -> Context:
    return context.get_current()


def extract(headers: Mapping[str, str]) -> Context:
    """A parent context from W3C headers (`traceparent`, `tracestate`), if any."""
    return _PROPAGATOR.extract(headers)


def span_context_of(value: str) -> trace.SpanContext | None:
    """The span context a traceparent string names (None when it is not valid)."""
    if not value:
        return None
    ctx = trace.get_current_span(_PROPAGATOR.extract({"traceparent": value})).get_span_context()
    return ctx if ctx.is_valid else None


@contextmanager
def stage(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span for one pipeline stage. A failure marks it with the error's type and code
    only: exception messages are not copied into traces (they may quote input)."""
    with tracer.start_as_current_span(name, attributes=attributes or None,
                                      record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                span.set_attribute("error.type", str(getattr(exc, "code", None)
                                                     or type(exc).__name__))
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            raise


def ids() -> tuple[str, str]:
    """(trace_id, span_id) of the current span as hex, or ("", "")."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


@dataclass
class RequestScope:
    """What is known about the request being served; the pipeline fills it in."""

    route: str
    protocol: str
    tenant: str = ""
    model: str = ""
    request_id: str = ""
    status: int = 0
    began: float = field(default_factory=time.perf_counter)


_scope: ContextVar[RequestScope | None] = ContextVar("sluice_request_scope", default=None)


def current_scope() -> RequestScope | None:
    return _scope.get()


def enter_scope(scope: RequestScope) -> Any:
    return _scope.set(scope)


def leave_scope(token: Any) -> None:
    _scope.reset(token)


_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, trace and span ids, the
    request's tenant, request id, route and model, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        trace_id, span_id = ids()
        if trace_id:
            out["trace_id"], out["span_id"] = trace_id, span_id
        scope = _scope.get()
        if scope is not None:
            out.update({k: v for k, v in (("tenant", scope.tenant),
                                          ("request_id", scope.request_id),
                                          ("route", scope.route), ("model", scope.model)) if v})
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_text:
            out["exception"] = record.exc_text
        elif record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()
