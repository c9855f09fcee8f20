"""Typed API errors, one vocabulary for every protocol.

Each error knows its HTTP status and OpenAI-style `type`/`code`; the REST, SSE, WebSocket
and gRPC adapters translate the same exception to their own wire format. Messages are
written for the caller and must never carry secrets, personal data or stack traces.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sluice.pii.redaction import redact


class ApiError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.headers = headers or {}
        self.details = details  # machine-readable extras, beside OpenAI's four fields

    def body(self) -> dict[str, Any]:
        # Messages may quote what the caller sent: redacted like everything emitted.
        body = error_body(redact(self.message), type=self.type, code=self.code,
                          param=self.param)
        if self.details:
            body["error"].update(self.details)
        return body


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# The envelope above as a JSON Schema (OpenAPI 3.1), for the documents that describe it.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}


def error_response_doc(description: str) -> dict[str, Any]:
    """An OpenAPI response object for an error: the envelope, as components/Error."""
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class ContentBlocked(BadRequest):
    """A guardrail policy refused the call (governance/guardrails/): the message names
    the policy, never what it found. `audit`: the verdicts, for the call's audit event."""

    default_code = "content_blocked"

    def __init__(self, policy: str, *, audit: dict[str, Any] | None = None) -> None:
        super().__init__(f"The request was blocked by the guardrail policy '{policy}'.",
                         details={"policy": policy})
        self.audit = audit or {}


class Unauthenticated(ApiError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"

    def __init__(self, message: str = "Invalid or missing credentials.", **kw: Any) -> None:
        kw.setdefault("headers", {"WWW-Authenticate": 'Bearer realm="sluice"'})
        super().__init__(message, **kw)


class PermissionDenied(ApiError):
    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class Unprocessable(ApiError):
    status = 422
    type = "invalid_request_error"
    default_code = "validation_error"


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, **kw: Any) -> None:
        headers = kw.pop("headers", {}) or {}
        headers.setdefault("Retry-After", str(max(1, round(retry_after_s))))
        super().__init__(message, headers=headers, **kw)
        self.retry_after_s = retry_after_s


class QuotaExceeded(RateLimited):
    """A tenant x model quota is used up (OpenAI's type for running out of quota)."""

    type = "insufficient_quota"
    default_code = "quota_exceeded"


class BudgetExceeded(QuotaExceeded):
    """A spend budget (of a tenant, a member or a key) cannot afford the call.
    `fallback_model`: where the budget sends such calls instead ("": nowhere)."""

    default_code = "budget_exceeded"
    fallback_model = ""


class Unavailable(ApiError):
    status = 503
    type = "service_unavailable"
    default_code = "overloaded"


def database_unavailable() -> Unavailable:
    """What a caller gets when the database fails under its call (a restart, a
    failover, a connection cut): retriable, like a queue outage, never a 500."""
    return Unavailable("The database is unavailable; try again shortly.",
                       code="database_unavailable", headers={"Retry-After": "1"})


def audit_unavailable() -> Unavailable:
    """What a caller gets while the audit log cannot take its call's event (the audit
    writer has fallen too far behind): retriable; the call is not served unaudited."""
    return Unavailable("The audit log is not keeping up; try again shortly.",
                       code="audit_unavailable", headers={"Retry-After": "5"})


def store_unavailable() -> Unavailable:
    """What a caller asking to store its response gets while the responses writer has
    fallen too far behind: retriable; the response is not kept where it may be lost."""
    return Unavailable("Stored responses are not keeping up; try again shortly, or "
                       "call with store=false.", code="store_unavailable",
                       headers={"Retry-After": "5"})


class DeadlineExceeded(ApiError):
    status = 504
    type = "timeout_error"
    default_code = "deadline_exceeded"


class ServerError(ApiError):
    status = 500
    type = "server_error"
    default_code = "internal_error"
