"""One served request, observed the same way on every protocol: its server span, its
request scope (tenant, model, request id for logs), its metrics and its access log line.

    with served("/v1/chat/completions", "rest", method="POST", headers=h) as scope:
        ... the adapter runs the call, and sets scope.status ...

Access logs are sampled dynamically: errors (status >= 400) and slow requests
(>= SLUICE_LOG_SLOW_MS) are always written, routes under SLUICE_LOG_CRITICAL_ROUTES
always, and the rest at about SLUICE_LOG_SAMPLE_PER_S lines per second per process,
so the kept fraction falls as QPS rises. Each line says the rate it was kept at
(`sample_rate`), so counts can be re-weighted.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from sluice.observability import metrics, telemetry

access_logger = logging.getLogger("sluice.access")


class LogSampler:
    """Decides, in a few hundred nanoseconds, whether a request's access line is kept."""

    def __init__(self, per_second: float, slow_s: float, critical: tuple[str, ...]) -> None:
        self.per_second = per_second
        self.slow_s = slow_s
        self.critical = critical
        self._window_start = time.monotonic()
        self._count = 0
        self._rate = 0.0  # requests per second over the last full window
        self._random = random.Random()  # noqa: S311 - sampling, not security

    def rate(self, route: str, status: int, seconds: float) -> float:
        """1.0 to keep always, else the keep probability (0 < p <= 1) for this request;
        0.0 means dropped. Counts the request towards the QPS estimate."""
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self._rate = self._count / (now - self._window_start)
            self._window_start, self._count = now, 0
        self._count += 1
        if status >= 400 or seconds >= self.slow_s or route.startswith(self.critical):
            return 1.0
        qps = max(self._rate, float(self._count))
        if qps <= self.per_second:
            return 1.0
        p = self.per_second / qps
        return p if self._random.random() < p else 0.0


_sampler: LogSampler | None = None


def sampler() -> LogSampler:
    global _sampler
    if _sampler is None:
        _sampler = LogSampler(float(settings.SLUICE_LOG_SAMPLE_PER_S),
                              float(settings.SLUICE_LOG_SLOW_MS) / 1000,
                              tuple(settings.SLUICE_LOG_CRITICAL_ROUTES))
    return _sampler


class served:  # used like a function: `with served(...) as scope:`
    """Observe one request. The adapter sets `scope.status` (an HTTP-equivalent status)
    and may refine `scope.protocol` (rest -> sse) and `scope.route`; an exception that
    escapes counts as 500 unless a status was set. A plain class rather than a generator
    context manager: this runs for every request, and the difference is measurable."""

    __slots__ = ("_context", "_method", "_span", "_token", "scope")

    def __init__(self, route: str, protocol: str, *, method: str = "POST",
                 headers: Mapping[str, str] | None = None) -> None:
        self.scope = telemetry.RequestScope(route=route, protocol=protocol)
        self._method = method
        parent = telemetry.extract(headers) if headers and "traceparent" in headers else None
        self._span = telemetry.server_span(_span_name(method, route), parent, SpanKind.SERVER)
        self._context = otel_context.attach(trace.set_span_in_context(self._span, parent))
        self._token = telemetry.enter_scope(self.scope)

    def __enter__(self) -> telemetry.RequestScope:
        return self.scope

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: Any) -> None:
        scope, span, method = self.scope, self._span, self._method
        try:
            if exc is not None:
                scope.status = scope.status or 500
            seconds = time.perf_counter() - scope.began
            if span.is_recording():
                span.update_name(_span_name(method, scope.route))
                span.set_attributes({
                    **({"rpc.system": "grpc", "rpc.method": scope.route}
                       if scope.protocol == "grpc" else
                       {"http.request.method": method, "http.route": scope.route}),
                    "http.response.status_code": scope.status,
                    "sluice.protocol": scope.protocol, "sluice.tenant": scope.tenant,
                    "gen_ai.request.model": scope.model,
                    "sluice.request_id": scope.request_id})
                if scope.status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            span.end()
            metrics.observe_request(scope.route, scope.protocol, scope.model, scope.status,
                                    seconds)
            _access_log(method, scope, seconds)
        finally:
            otel_context.detach(self._context)
            telemetry.leave_scope(self._token)


def _span_name(method: str, route: str) -> str:
    """`POST /v1/chat/completions`; a gRPC method is named as gRPC does
    (`sluice.v1.Inference/Chat`)."""
    return f"{method} {route}" if method else route.lstrip("/")


def _access_log(method: str, scope: telemetry.RequestScope, seconds: float) -> None:
    if not access_logger.isEnabledFor(logging.INFO):
        return
    rate = sampler().rate(scope.route, scope.status, seconds)
    if rate:
        fields = {"protocol": scope.protocol, "status": scope.status,
                  "duration_ms": round(seconds * 1000, 2), "sample_rate": round(rate, 4)}
        access_logger.info("%s %s %d", method or scope.protocol, scope.route, scope.status,
                           extra=fields)
