"""OpenTelemetry, set up once per process, and the JSON log format.

Every process entry point calls `setup(service)`: the ASGI app, `rungrpc`, `runworker`
and the Celery worker. `SLUICE_TRACING` chooses what tracing costs:

    auto (default)  with an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
                    `..._TRACES_ENDPOINT`, OTLP/HTTP): record and export a share of the
                    traces, SLUICE_TRACE_SAMPLE_RATIO (0.1) of new ones, every one whose
                    caller sent a sampled traceparent. Without one: nothing is recorded
                    but spans still carry trace ids, so logs, audit events and the
                    queue's traceparent stay correlated
    on              record every trace (exported when an endpoint is set; tests add an
                    in-memory exporter to `provider()`)
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
import random
import re
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_configured: str | None = None
_ids_only = False  # the sampler records nothing: spans are only ids (see server_span)
tracer = trace.get_tracer("sluice")  # a proxy: follows the provider set by setup()


def setup(service: str, mode: str | None = None) -> str:
    """Install the tracer provider for this process (idempotent); returns the mode."""
    global _configured, _ids_only
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
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                     or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    kwargs: dict[str, Any] = {}
    if os.environ.get("OTEL_TRACES_SAMPLER"):
        pass  # the SDK reads the standard variables itself
    elif mode == "on":
        kwargs["sampler"] = ParentBased(ALWAYS_ON)
    elif exporting:
        ratio = float(os.environ.get("SLUICE_TRACE_SAMPLE_RATIO", "0.1"))
        kwargs["sampler"] = ParentBased(TraceIdRatioBased(ratio))
    else:
        kwargs["sampler"] = ALWAYS_OFF  # ids without the cost of recording
        _ids_only = True
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service),
                                "service.namespace": "sluice"})
    provider = TracerProvider(resource=resource, **kwargs)
    if exporting:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return mode


def server_span(name: str, parent: Context | None, kind: trace.SpanKind) -> trace.Span:
    """The span of one served request. When nothing is recorded, only its ids are made
    (the parent's trace id, or a new one), without the SDK's span machinery: this runs
    for every request."""
    if not _ids_only:
        return tracer.start_span(name, context=parent, kind=kind)
    caller = trace.get_current_span(parent).get_span_context() if parent is not None else None
    trace_id = caller.trace_id if caller is not None and caller.is_valid else \
        random.getrandbits(128)
    return trace.NonRecordingSpan(trace.SpanContext(trace_id, random.getrandbits(64),
                                                    is_remote=False))


def provider() -> Any:
    """The SDK TracerProvider this process set up (tests attach exporters to it)."""
    return trace.get_tracer_provider()


def shutdown() -> None:
    """Flush what the exporter still holds (called on a clean process exit)."""
    close = getattr(trace.get_tracer_provider(), "shutdown", None)
    if close is not None:
        close()


def current_context() -> Context:
    return context.get_current()


def extract(headers: Mapping[str, str]) -> Context:
    """A parent context from W3C headers (`traceparent`, `tracestate`), if any."""
    return _PROPAGATOR.extract(headers)


_TRACEPARENT = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)")


def span_context_of(value: str) -> trace.SpanContext | None:
    """The (remote) span context a W3C traceparent names; None when it is not valid. The
    spec's rules, read directly (the propagator builds a context and a span around it:
    ~20 µs, and a worker reads one per request): version ff is invalid, version 00 has
    no trailing fields, all-zero ids are invalid, as is a header over 512 characters."""
    match = _TRACEPARENT.fullmatch(value) if value and len(value) <= 512 else None
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(int(flags, 16)))


def child_span(name: str, parent: Context, attributes: dict[str, Any]) -> trace.Span:
    """A span under `parent` that is not made current (ended by the caller); in an
    unsampled trace, the parent's own non-recording span (a stand-in would carry the
    same ids, and ending or annotating it does nothing either way)."""
    current = trace.get_current_span(parent)
    if not current.is_recording() and current.get_span_context().is_valid:
        return current
    return tracer.start_span(name, context=parent, attributes=attributes)


class stage:  # used like a function: `with stage("sluice.auth") as span:`
    """A span for one pipeline stage, a child of the current span without becoming the
    current one itself (stages are leaves; not attaching a context keeps them cheap). A
    failure marks it with the error's type and code only: exception messages are not
    copied into traces (they may quote input)."""

    __slots__ = ("span",)

    def __init__(self, name: str, **attributes: Any) -> None:
        # In an unsampled trace no child would be recorded either: child_span reuses
        # the parent's ids (for logs and the queue) instead of minting a span.
        self.span = child_span(name, context.get_current(), attributes)

    def __enter__(self) -> trace.Span:
        return self.span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: Any) -> None:
        if exc is not None and self.span.is_recording():
            self.span.set_attribute("error.type", str(getattr(exc, "code", None)
                                                      or type(exc).__name__))
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        self.span.end()


def traceparent_of(span: trace.Span) -> str:
    """A span's W3C traceparent ("" when it has no valid context)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


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
