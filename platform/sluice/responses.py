"""JSON responses for the Django side (management API, health, error pages)."""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpResponse

from sluice.errors import ApiError


def json_response(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def error_response(exc: ApiError) -> HttpResponse:
    response = json_response(exc.body(), status=exc.status)
    for name, value in exc.headers.items():
        response[name] = value
    return response
