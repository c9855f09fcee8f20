"""The hot path's view of authentication: principals cached in-process.

The lean /v1 inference path must not query the database per request. A credential's
principal is cached by the SHA-256 of the credential for SLUICE_AUTH_CACHE_TTL_S
(default 10 s); failures are not cached. Every identity change (key revoked, member
removed or demoted, tenant disabled) bumps an epoch counter in Redis; each process looks
at it at most once a second and drops its whole cache when it moved, so a revocation
reaches the inference path within about a second.
"""

from __future__ import annotations

import hashlib
import logging
import time

from django.conf import settings
from django.db import transaction

from sluice.db import async_db
from sluice.redis import async_redis, sync_redis
from sluice.ttlcache import AsyncTTLCache
from tenants.authentication import authenticate
from tenants.principal import Principal

logger = logging.getLogger(__name__)
EPOCH_KEY = "sluice:auth:epoch"
_EPOCH_CHECK_S = 1.0
_MAX_ENTRIES = 100_000

_cache: AsyncTTLCache[str, Principal] = AsyncTTLCache(max_entries=_MAX_ENTRIES)
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
    await _check_epoch(time.monotonic())
    # Keyed by a digest, so the cache never holds a credential; failures are not cached.
    key = hashlib.sha256(token.encode()).hexdigest()
    return await _cache.get(key, lambda: async_db(authenticate)(token),
                            float(settings.SLUICE_AUTH_CACHE_TTL_S))


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
