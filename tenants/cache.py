"""The hot path's view of authentication: principals cached in-process.

The lean /v1 inference path must not query the database per request. A credential's
principal is cached by the SHA-256 of the credential for SLUICE_AUTH_CACHE_TTL_S
(default 10 s); failures are not cached. Every identity change (key revoked, member
removed or demoted, tenant disabled) bumps an epoch counter in Redis; each process looks
at it at most once a second and drops its whole cache when it moved, so a revocation
reaches the inference path within about a second.

A hit costs no I/O; only a miss goes to the database (in a thread), and only a wrong key
goes to Redis (tenants/throttle.py counts it against `source`).
"""

from __future__ import annotations

import hashlib

from django.conf import settings

from sluice.db import async_db
from sluice.epoch import Epoch
from sluice.ttlcache import AsyncTTLCache
from tenants.authentication import authenticate
from tenants.principal import Principal

EPOCH_KEY = "sluice:auth:epoch"
_MAX_ENTRIES = 100_000

_cache: AsyncTTLCache[str, Principal] = AsyncTTLCache(max_entries=_MAX_ENTRIES)
_epoch = Epoch(EPOCH_KEY)


async def authenticate_cached(token: str, *, source: str | None = None) -> Principal:
    """`source`: the client's address (throttle.client_source); None counts no source.
    Concurrent misses for one credential share one load, so they count as one failure."""
    if await _epoch.moved():
        _cache.clear()
    # Keyed by a digest, so the cache never holds a credential; failures are not cached.
    key = hashlib.sha256(token.encode()).hexdigest()
    return await _cache.get(key, lambda: async_db(authenticate)(token, source=source),
                            float(settings.SLUICE_AUTH_CACHE_TTL_S))


def invalidate() -> None:
    """Call from a service that changed who may do what; takes effect on commit."""
    _epoch.bump_on_commit()


def clear() -> None:
    _cache.clear()
    _epoch.reset()
