"""Shared Redis clients (one pool per process and event loop)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from django.conf import settings

_sync: redis.Redis | None = None


def sync_redis() -> redis.Redis:
    global _sync
    if _sync is None:
        _sync = redis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
            socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
    return _sync


def async_redis() -> aioredis.Redis:
    """A new asyncio client; callers keep one per event loop."""
    return aioredis.Redis.from_url(
        settings.REDIS_URL,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
    )
