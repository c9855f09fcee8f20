"""Liveness and readiness probes."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse

from sluice.redis import sync_redis
from sluice.responses import json_response


def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up and serving."""
    return json_response({"status": "ok"})


def readyz(request: HttpRequest) -> HttpResponse:
    """The process can serve: its database and Redis answer. 503 names what failed."""
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        sync_redis().ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    ready = all(value == "ok" for value in checks.values())
    return json_response({"status": "ok" if ready else "unavailable", "checks": checks},
                         status=200 if ready else 503)
