"""JSON logs carry trace and request ids and pass redaction first; access-log sampling
keeps errors, slow and critical requests and thins the rest as QPS rises."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.observability import telemetry
from sluice.observability.observe import LogSampler, served
from sluice.pii.logredact import RedactingFilter


def _logger() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(telemetry.JsonFormatter())
    log = logging.getLogger("sluice.test.json")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, out


def test_json_lines_carry_trace_and_request_ids_and_are_redacted(
        spans: InMemorySpanExporter, db: None) -> None:
    log, out = _logger()
    with served("/v1/chat/completions", "rest") as scope:
        scope.tenant, scope.model, scope.request_id = "acme", "echo", "abc123"
        log.info("mail from %s", "jane.doe@example.com", extra={"attempt": 2})
        try:
            raise ValueError("card 4111 1111 1111 1111 refused")
        except ValueError:
            log.exception("failed")
        scope.status = 200
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    server = next(s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions")
    assert first["trace_id"] == format(server.context.trace_id, "032x")
    assert first["span_id"] == format(server.context.span_id, "016x")
    assert (first["tenant"], first["model"], first["request_id"]) == ("acme", "echo", "abc123")
    assert first["route"] == "/v1/chat/completions"
    assert first["attempt"] == 2 and first["level"] == "INFO"
    assert "jane.doe@example.com" not in out.getvalue()
    assert first["message"] == "mail from [EMAIL]"
    assert "4111" not in second["exception"] and "ValueError" in second["exception"]


def test_outside_a_request_lines_have_no_request_fields() -> None:
    log, out = _logger()
    log.warning("plain")
    line = json.loads(out.getvalue())
    assert line["message"] == "plain" and "tenant" not in line and "request_id" not in line


def test_errors_slow_and_critical_requests_are_always_kept() -> None:
    sampler = LogSampler(per_second=1, slow_s=0.5, critical=("/v1/auth/",))
    for _ in range(5000):
        sampler.rate("/v1/chat/completions", 200, 0.001)  # drive the QPS estimate up
    assert all(sampler.rate("/v1/chat/completions", 503, 0.001) == 1.0 for _ in range(100))
    assert all(sampler.rate("/v1/chat/completions", 429, 0.001) == 1.0 for _ in range(100))
    assert all(sampler.rate("/v1/chat/completions", 200, 0.6) == 1.0 for _ in range(100))
    assert all(sampler.rate("/v1/auth/token", 200, 0.001) == 1.0 for _ in range(100))


def test_the_kept_share_falls_as_qps_rises() -> None:
    sampler = LogSampler(per_second=20, slow_s=10, critical=())
    # Below the budget everything is kept.
    assert all(sampler.rate("/r", 200, 0.001) == 1.0 for _ in range(20))
    # A burst far above it: about `per_second` lines a second survive, each tagged
    # with the probability it was kept at.
    kept = [r for r in (sampler.rate("/r", 200, 0.001) for _ in range(50_000)) if r]
    assert 20 < len(kept) < 400
    assert min(kept) < 0.01


def test_qps_estimate_follows_the_last_second(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sampler = LogSampler(per_second=10, slow_s=10, critical=())
    for _ in range(1000):  # 1,000 requests in the first second
        sampler.rate("/r", 200, 0.001)
    clock[0] += 1.0
    sampler.rate("/r", 200, 0.001)
    kept = sum(1 for _ in range(1000) if sampler.rate("/r", 200, 0.001))
    assert kept < 100  # ~1% kept at ~1,000 QPS
    clock[0] += 5.0  # quiet again: the next window sees low QPS and keeps everything
    sampler.rate("/r", 200, 0.001)
    clock[0] += 1.0
    assert all(sampler.rate("/r", 200, 0.001) == 1.0 for _ in range(5))


_TRACE, _SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize("value", [
    f"00-{_TRACE}-{_SPAN}-01", f"00-{_TRACE}-{_SPAN}-00", f"01-{_TRACE}-{_SPAN}-01-future",
    f"00-{_TRACE}-{_SPAN}-01-extra", f"ff-{_TRACE}-{_SPAN}-01", f"00-{'0' * 32}-{_SPAN}-01",
    f"00-{_TRACE}-{'0' * 16}-01", f"00-{_TRACE.upper()}-{_SPAN}-01", f"00-{_TRACE}-{_SPAN}",
    f"00-{_TRACE[:-1]}-{_SPAN}-01", f"0-{_TRACE}-{_SPAN}-01", "", "garbage",
    f" 00-{_TRACE}-{_SPAN}-01", f"00-{_TRACE}-{_SPAN}-01\t", f"00-{_TRACE}-{_SPAN}-0g",
    f"01-{_TRACE}-{_SPAN}-01-{'x' * 500}",
])
def test_a_traceparent_reads_as_the_w3c_propagator_reads_it(value: str) -> None:
    """The worker's direct parse (one per queued request) against OpenTelemetry's own
    propagator, valid and invalid headers alike."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = trace.get_current_span(
        TraceContextTextMapPropagator().extract({"traceparent": value})).get_span_context()
    expected = ctx if ctx.is_valid else None
    assert telemetry.span_context_of(value) == expected
