"""Shared Redis clients (one pool per process and event loop), and Lua scripts in pipelines."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import NoScriptError

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


class ScriptBatch:
    """A pipeline that runs Lua scripts by EVALSHA without redis-py's per-execute
    `SCRIPT EXISTS` round trip (what `Script(..., client=pipe)` costs every time). A
    script Redis does not know (first use, or after a restart) is run once with EVAL,
    which also caches it; no other command of the batch runs twice.

    Works with a sync or an asyncio client: `run()` or `await run_async()`."""

    def __init__(self, client: redis.Redis | aioredis.Redis) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self._scripts: dict[int, tuple[str, list[Any]]] = {}

    def script(self, source: str, keys: list[str], args: list[Any]) -> None:
        argv = [len(keys), *keys, *args]
        self._scripts[len(self.pipe.command_stack)] = (source, argv)
        self.pipe.evalsha(sha1(source), *argv)

    def _failures(self, replies: list[Any]) -> list[tuple[int, str, list[Any]]]:
        missing = []
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError) and i in self._scripts:
                missing.append((i, *self._scripts[i]))
            elif isinstance(reply, Exception):
                raise reply
        return missing

    def run(self) -> list[Any]:
        replies = self.pipe.execute(raise_on_error=False)
        for i, source, argv in self._failures(replies):
            replies[i] = self.client.eval(source, *argv)
        return list(replies)

    async def run_async(self) -> list[Any]:
        replies = await self.pipe.execute(raise_on_error=False)
        for i, source, argv in self._failures(replies):
            replies[i] = await self.client.eval(source, *argv)
        return list(replies)


@functools.cache
def sha1(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
