"""The hot path's view of authentication: principals cached in-process.

The lean /v1 inference path must not query the database per request. A credential's
principal is cached by the SHA-256 of the credential for SLUICE_AUTH_CACHE_TTL_S
(default 10 s); failures are not cached. Every identity change (key revoked, member
removed or demoted, tenant disabled) bumps an epoch counter in Redis; each process looks
at it at most once a second and drops its whole cache when it moved, so a revocation
reaches the inference path within about a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from django.conf import settings
from django.db import transaction

from sluice.db import async_db
from sluice.redis import async_redis, sync_redis
from tenants.authentication import authenticate
from tenants.principal import Principal

logger = logging.getLogger(__name__)
EPOCH_KEY = "sluice:auth:epoch"
_EPOCH_CHECK_S = 1.0
_MAX_ENTRIES = 100_000

_cache: dict[str, tuple[float, Principal]] = {}
_inflight: dict[str, asyncio.Future[Principal]] = {}
_epoch: bytes | None = None
_epoch_checked = 0.0
_redis = None


async def _check_epoch(now: float) -> None:
    global _epoch, _epoch_checked, _redis
    if now - _epoch_checked < _EPOCH_CHECK_S:
        return
    _epoch_checked = now
    try:
        if _redis is None:
            _redis = async_redis()
        epoch = await _redis.get(EPOCH_KEY)
    except Exception:  # Redis down: keep serving from the TTL-bounded cache
        logger.warning("auth epoch unavailable; relying on the cache TTL", exc_info=True)
        _redis = None
        return
    if epoch != _epoch:
        _cache.clear()
        _epoch = epoch


async def authenticate_cached(token: str) -> Principal:
    key = hashlib.sha256(token.encode()).hexdigest()
    now = time.monotonic()
    await _check_epoch(now)
    hit = _cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    # Concurrent misses for one credential share one database lookup.
    pending = _inflight.get(key)
    if pending is not None:
        return await asyncio.shield(pending)
    task = asyncio.ensure_future(async_db(authenticate)(token))
    _inflight[key] = task
    try:
        principal = await asyncio.shield(task)
    finally:
        _inflight.pop(key, None)
    if len(_cache) >= _MAX_ENTRIES:
        _cache.clear()  # crude but bounded; a busy gateway refills it within seconds
    _cache[key] = (now + float(settings.SLUICE_AUTH_CACHE_TTL_S), principal)
    return principal


def invalidate() -> None:
    """Call from a service that changed who may do what; takes effect on commit."""

    def bump() -> None:
        try:
            sync_redis().incr(EPOCH_KEY)
        except Exception:  # the TTL still bounds staleness
            logger.warning("could not bump the auth epoch", exc_info=True)

    transaction.on_commit(bump)


def clear() -> None:
    global _epoch, _epoch_checked, _redis
    _cache.clear()
    _epoch, _epoch_checked, _redis = None, 0.0, None
