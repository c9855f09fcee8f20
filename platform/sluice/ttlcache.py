"""A small in-process cache for the async hot path: entries expire after a TTL, and
concurrent misses for one key share a single load (no thundering herd at expiry)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class AsyncTTLCache(Generic[K, V]):
    def __init__(self, *, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}
        self._inflight: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, load: Callable[[], Awaitable[V]], ttl_s: float) -> V:
        """The cached value, else `load()`'s (a failing load is not cached)."""
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        task = asyncio.ensure_future(load())
        self._inflight[key] = task
        try:
            value = await asyncio.shield(task)
        finally:
            self._inflight.pop(key, None)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # crude but bounded; a busy process refills it in seconds
        self._entries[key] = (now + ttl_s, value)
        return value

    def discard(self, key: K) -> None:
        """Forget one entry (a load in flight still completes for its waiters)."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
