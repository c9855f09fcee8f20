"""Database access from async code outside Django's request cycle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

P = ParamSpec("P")
R = TypeVar("R")


def async_db(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """Run an ORM function in a worker thread, treating each call like a request:
    connections past CONN_MAX_AGE (or broken) are closed before and after, as Django's
    request_started/request_finished handlers would."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False)
