"""The one NinjaAPI: mounts every app's router and maps every error to OpenAI's shape."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.db import DataError
from django.http import Http404, HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer

from governance.api import router as governance_router
from governance.guardrails.api import router as guardrails_router
from inference.api import models_router
from inference.api import router as inference_router
from sluice.db import OUTAGE
from sluice.errors import (
    ERROR_SCHEMA,
    ApiError,
    BadRequest,
    NotFound,
    PayloadTooLarge,
    ServerError,
    Unauthenticated,
    Unprocessable,
    database_unavailable,
    error_response_doc,
)
from sluice.responses import error_response
from sluice.schemas import CONTROL_PATTERNS
from streaming.api import router as batch_router
from streaming.transports.openapi import add_inference_routes
from tenants.api import auth_router
from tenants.api import router as tenants_router
from tenants.authentication import authenticate
from tenants.principal import Principal
from tenants.throttle import http_source

logger = logging.getLogger(__name__)


class BearerAuth(HttpBearer):
    """`Authorization: Bearer <API key or JWT>` to a Principal (request.auth)."""

    def authenticate(self, request: HttpRequest, token: str) -> Principal:
        return authenticate(token, source=http_source(request.META))


class SluiceAPI(NinjaAPI):
    """NinjaAPI whose OpenAPI document also says what every operation answers when it
    refuses: any 4XX carries the OpenAI error envelope (clients and Schemathesis can
    check error bodies against it, not just successes)."""

    def get_openapi_schema(self, *args: Any, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(*args, **kwargs)
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        refusal = error_response_doc("Refused: an OpenAI-style error envelope (400 bad "
                                     "input, 401 credentials, 403 role or tenant, 404, "
                                     "409, 413, 422 validation, 429 limits).")
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.setdefault("responses", {}).setdefault("4XX", refusal)
        add_inference_routes(schema)  # the lean ASGI path's routes, outside Ninja
        return schema


api = SluiceAPI(
    title="Sluice management API",
    version="1",
    description="Tenants, members, API keys and tokens, governance and audit; the "
                "OpenAI-compatible inference routes under /v1.",
    auth=BearerAuth(),
    urls_namespace="api",
    docs_url="/api/docs",
    openapi_url="/api/openapi.json",
)
api.add_router("/api/v1/", tenants_router)
api.add_router("/api/v1/", inference_router)
api.add_router("/api/v1/", governance_router)
api.add_router("/api/v1/", guardrails_router)
api.add_router("/v1/auth/", auth_router)
api.add_router("/v1/", models_router)
api.add_router("/v1/", batch_router)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "data", "query",
                                                                       "path")]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return f"Unknown field '{param}'.", param, "unknown_field"
    if first.get("type") == "missing":
        return f"Missing required field '{param}'.", param, "missing_field"
    if (first.get("type") == "string_pattern_mismatch"
            and (first.get("ctx") or {}).get("pattern") in CONTROL_PATTERNS):
        # sluice.schemas.Line / Text: say what is wrong, not the regular expression.
        return (f"{param}: must not contain control characters (such as NUL).", param,
                "control_character")
    msg = str(first.get("msg", "Invalid request."))
    return (f"{param}: {msg}" if param else msg), param, "validation_error"


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return error_response(exc)


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    message, param, code = _validation_message(list(exc.errors))
    return error_response(Unprocessable(message, param=param, code=code))


@api.exception_handler(AuthenticationError)
def _auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return error_response(Unauthenticated("Missing bearer token (Authorization: Bearer ...)."))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400:  # ninja's "Cannot parse request body"
        return error_response(BadRequest("Request body is not valid JSON.", code="invalid_json"))
    if exc.status_code == 405:
        return error_response(BadRequest("Method not allowed.", code="method_not_allowed"))
    return error_response(BadRequest(str(exc)))


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return error_response(NotFound("Not found."))


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return error_response(PayloadTooLarge("Request body is too large."))


@api.exception_handler(DataError)
@api.exception_handler(OverflowError)
def _unstorable(request: HttpRequest, exc: Exception) -> HttpResponse:
    # A number past the database's range (PostgreSQL: DataError; SQLite: OverflowError)
    # or a NUL character in text that slipped past the schemas' types (sluice.schemas):
    # the caller's input, not our failure.
    return error_response(BadRequest("A value in the request is out of range or cannot be "
                                     "stored (numbers must fit in 64 bits; text must not "
                                     "contain NUL characters).", code="invalid_value"))


def _database_outage(request: HttpRequest, exc: Any) -> HttpResponse:
    logger.warning("database unavailable on %s %s: %s", request.method, request.path,
                   type(exc).__name__)
    return error_response(database_unavailable())


for _outage in OUTAGE:  # the async path's definition of an outage (sluice.db)
    api.add_exception_handler(_outage, _database_outage)


@api.exception_handler(MultiPartParserError)
def _bad_multipart(request: HttpRequest, exc: MultiPartParserError) -> HttpResponse:
    return error_response(BadRequest("The multipart body could not be parsed (a boundary "
                                     "is missing or malformed).", code="invalid_multipart"))


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    # The traceback goes to the server log (without the request body); the caller gets
    # an opaque, typed error.
    logger.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(ServerError("The server had an error processing your request."))
