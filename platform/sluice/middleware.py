"""Request guards that must run before Django reads a body, and the web UI's response
headers (CSP, Secure cookies on HTTPS)."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from sluice.bodylimit import route_limit
from sluice.errors import BadRequest, PayloadTooLarge, error_body
from sluice.observability.observe import served
from sluice.responses import error_response, json_response


class TelemetryMiddleware:
    """Every Django request (management API, auth, health aside) as a served request:
    server span, metrics and sampled access log, labelled by its URL pattern (never the
    raw path, which would make a label per id)."""

    UNOBSERVED = ("/healthz", "/readyz")

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path in self.UNOBSERVED:
            return self.get_response(request)
        headers = {k.lower(): v for k, v in request.headers.items()}
        with served("unmatched", "http", method=request.method or "GET",
                    headers=headers) as scope:
            response = self.get_response(request)
            match = request.resolver_match
            if match is not None:
                scope.route = "/" + str(match.route)
            scope.status = response.status_code
            return response


class BodySizeLimitMiddleware:
    """413 for a declared Content-Length above the route's limit (bodylimit.route_limit).

    Under the ASGI app the guard in front of Django (sluice.bodylimit) has refused such
    a body before Django read it; this covers Django served any other way (WSGI, the
    test client). Chunked bodies are caught there by Django's own
    DATA_UPLOAD_MAX_MEMORY_SIZE check (RequestDataTooBig, mapped to 413 too).
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return error_response(BadRequest("Content-Length is not a number."))
        limit = route_limit(request.path)
        if length > limit:
            return error_response(
                PayloadTooLarge(f"Request body is {length} bytes; the limit is {limit} bytes.")
            )
        return self.get_response(request)


_MESSAGES = {405: "Method not allowed.", 403: "Forbidden.", 404: "Not found."}
_CODES = {405: "method_not_allowed", 403: "forbidden", 404: "not_found"}


class JsonErrorMiddleware:
    """API paths answer errors in OpenAI's JSON shape, also the few that Django or ninja
    produce as HTML/plain text themselves (405 Method Not Allowed, CSRF failures...)."""

    API_PREFIXES = ("/api/", "/v1/")

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            response.status_code >= 400
            and request.path.startswith(self.API_PREFIXES)
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            status = response.status_code
            wrapped = json_response(error_body(
                _MESSAGES.get(status, "Request failed."),
                type="invalid_request_error" if status < 500 else "server_error",
                code=_CODES.get(status),
            ), status=status)
            if "Allow" in response:
                wrapped["Allow"] = response["Allow"]
            return wrapped
        return response



class UiSecurityHeadersMiddleware:
    """The admin UI's own headers: its Content-Security-Policy (settings.SLUICE_UI_CSP)
    on every response under /ui/. The UI loads one script and one stylesheet from
    /ui/static/ and nothing inline, so the policy allows 'self' only; the API's docs
    page, which loads Swagger from a CDN, is outside /ui/ and keeps none."""

    PREFIX = "/ui/"

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if request.path.startswith(self.PREFIX):
            response.headers.setdefault("Content-Security-Policy", settings.SLUICE_UI_CSP)
        return response


class SecureCookiesMiddleware:
    """Every cookie of a response to an HTTPS request is marked Secure (the session,
    CSRF and messages cookies), whatever SESSION_COOKIE_SECURE says: the flag follows
    the scheme the request came in on, so one deployment serves the plain-HTTP dev
    server and HTTPS alike. Behind a TLS-terminating proxy, request.is_secure() is true
    only when SECURE_PROXY_SSL_HEADER trusts its X-Forwarded-Proto
    (SLUICE_TRUST_X_FORWARDED_PROTO). Listed before the middleware that set cookies,
    so it sees theirs on the way out."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if request.is_secure():
            for morsel in response.cookies.values():
                morsel["secure"] = True
        return response
