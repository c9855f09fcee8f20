"""Liveness and readiness probes."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from django.db import connection
from django.http import HttpRequest, HttpResponse

from sluice.redis import sync_redis
from sluice.responses import json_response

# How long readiness waits for the database's answer: under a probe's usual 1 s timeout.
DATABASE_WAIT_S = 0.5

# The database check runs in a thread of its own, so that a database that does not
# answer (a connect waiting out SLUICE_DB_CONNECT_TIMEOUT_S) cannot hold the probe; at
# most one check is in flight, later probes read its outcome once it is there.
_probe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-readyz")
_in_flight: Future[None] | None = None
_lock = threading.Lock()


def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up and serving."""
    return json_response({"status": "ok"})


def readyz(request: HttpRequest) -> HttpResponse:
    """Ready when this process can serve its hot path: Redis (queue, limits, breakers)
    answers; 503 names what failed. A database that does not answer makes it
    `degraded`, still 200: the gateway serves the callers it has cached and answers the
    rest with a retriable 503, whereas failing every gateway's probe at once would take
    them all out of their load balancer and turn a database outage into a total one."""
    checks = {"database": _database()}
    try:
        sync_redis().ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    if checks["redis"] != "ok":
        status, code = "unavailable", 503
    else:
        status, code = ("ok" if checks["database"] == "ok" else "degraded"), 200
    return json_response({"status": status, "checks": checks}, status=code)


def _database() -> str:
    global _in_flight
    with _lock:
        if _in_flight is None:
            _in_flight = _probe.submit(_select_one)
        check = _in_flight
    try:
        check.result(timeout=DATABASE_WAIT_S)
        outcome = "ok"
    except FutureTimeout:
        return "timeout"
    except Exception as exc:
        outcome = f"error: {type(exc).__name__}"
    with _lock:
        if _in_flight is check:
            _in_flight = None
    return outcome


def _select_one() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        connection.close()  # this thread's own; a probe every few seconds can connect anew
