"""A cross-process "something changed" counter for in-process caches.

A service that changes what a cache holds bumps the epoch in Redis on commit; every
process looks at it at most once a second and drops its cache when it moved. The cache's
own TTL still bounds staleness when Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.db import transaction

from sluice.redis import async_redis, sync_redis

logger = logging.getLogger(__name__)


class Epoch:
    def __init__(self, key: str, *, check_every_s: float = 1.0) -> None:
        self.key = key
        self.check_every_s = check_every_s
        self._seen: bytes | None = None
        self._checked = 0.0
        self._redis: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def moved(self) -> bool:
        """True when the epoch changed since the last look (looks at most once a second)."""
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return False
        self._checked = now
        try:
            # One client per event loop (async_redis's rule): a connection made on one
            # loop must never be used from another (a server restarted in-process, a
            # second server in another thread).
            loop = asyncio.get_running_loop()
            if self._redis is None or self._loop is not loop:
                self._redis, self._loop = async_redis(), loop
            value = await self._redis.get(self.key)
        except Exception:  # Redis down: keep serving from the TTL-bounded cache
            logger.warning("%s unavailable; relying on the cache TTL", self.key, exc_info=True)
            self._redis = None
            return False
        if value != self._seen:
            self._seen = value
            return True
        return False

    def bump_on_commit(self) -> None:
        def bump() -> None:
            try:
                sync_redis().incr(self.key)
            except Exception:  # the TTL still bounds staleness
                logger.warning("could not bump %s", self.key, exc_info=True)

        transaction.on_commit(bump)

    def reset(self) -> None:
        self._seen, self._checked, self._redis, self._loop = None, 0.0, None, None
