"""The hot path's view of authentication: principals cached in-process for a few seconds.

The lean /v1 inference path must not query the database per request. A credential's
principal is cached by the SHA-256 of the credential for SLUICE_AUTH_CACHE_TTL_S
(default 10 s); failures are not cached. A revoked key or removed member therefore
keeps working on the inference path for at most that long (the management API always
checks the database).
"""

from __future__ import annotations

import hashlib
import time

from asgiref.sync import sync_to_async
from django.conf import settings

from tenants.authentication import authenticate
from tenants.principal import Principal

_cache: dict[str, tuple[float, Principal]] = {}
_MAX_ENTRIES = 100_000


async def authenticate_cached(token: str) -> Principal:
    key = hashlib.sha256(token.encode()).hexdigest()
    now = time.monotonic()
    hit = _cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    principal = await sync_to_async(authenticate, thread_sensitive=False)(token)
    if len(_cache) >= _MAX_ENTRIES:
        _cache.clear()  # crude but bounded; a busy gateway refills it within seconds
    _cache[key] = (now + float(getattr(settings, "SLUICE_AUTH_CACHE_TTL_S", 10)), principal)
    return principal


def clear() -> None:
    _cache.clear()
