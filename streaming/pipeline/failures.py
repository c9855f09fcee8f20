"""Failures as callers get them: Redis failing under a call, and a worker's error event
as the typed error every adapter knows how to send."""

from __future__ import annotations

from inference.jobs import ErrorEvent
from sluice.errors import ApiError, BadRequest, DeadlineExceeded, ServerError, Unavailable


def queue_unavailable() -> Unavailable:
    """What a caller gets when Redis (the queue) fails under its call: retriable."""
    return Unavailable("The request queue is unavailable; try again shortly.",
                       code="queue_unavailable", headers={"Retry-After": "1"})


def error_from_event(event: ErrorEvent) -> ApiError:
    """A worker's error event as the typed error every adapter knows how to send. One
    the worker marks as certain to fail again (`"retry": false`: a model fault on this
    input, a dead-lettered request) tells the OpenAI SDKs not to retry it, as they
    would any 5xx (`x-should-retry: false`, a header they honour)."""
    status, code, message = event["status"], event["code"], event["message"]
    headers = {"x-should-retry": "false"} if event.get("retry") is False else None
    if status == 504:
        return DeadlineExceeded(message, code=code, headers=headers)
    if status == 503:
        return Unavailable(message, code=code, headers=headers)
    if 400 <= status < 500:
        return BadRequest(message, code=code, headers=headers)
    return ServerError(message, code=code, headers=headers)
