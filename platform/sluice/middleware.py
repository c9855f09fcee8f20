"""Request guards that must run before Django reads a body."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from sluice.errors import BadRequest, PayloadTooLarge
from sluice.responses import error_response


class BodySizeLimitMiddleware:
    """413 for a declared Content-Length above the limit, before anything reads the body.

    Chunked bodies without a length are caught later, when Django's own
    DATA_UPLOAD_MAX_MEMORY_SIZE check raises RequestDataTooBig (mapped to 413 too).
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return error_response(BadRequest("Content-Length is not a number."))
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if length > limit:
            return error_response(
                PayloadTooLarge(f"Request body is {length} bytes; the limit is {limit} bytes.")
            )
        return self.get_response(request)
