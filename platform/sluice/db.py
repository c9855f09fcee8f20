"""Database access from async code outside Django's request cycle."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections

from sluice.errors import database_unavailable

logger = logging.getLogger("sluice.db")
# What a database outage raises (refused or cut connections, a server shutting down,
# SQLite's "database is locked"), as opposed to a bad query or bad data.
OUTAGE = (OperationalError, InterfaceError)

P = ParamSpec("P")
R = TypeVar("R")


def async_db(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """Run an ORM function in a worker thread, treating each call like a request:
    connections past CONN_MAX_AGE (or broken) are closed before and after, as Django's
    request_started/request_finished handlers would. A database outage raises the
    retriable 503 every adapter knows (`database_unavailable`)."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            close_old_connections()
            return fn(*args, **kwargs)
        except OUTAGE as exc:
            logger.warning("database unavailable: %s", type(exc).__name__)
            raise database_unavailable() from None
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False)
