"""Deployment specs for the hot path, cached in-process for a few seconds so that the
lean /v1 path does not read the registry per request. An edit reaches every gateway
process within SLUICE_REGISTRY_CACHE_TTL_S (default 5 s)."""

from __future__ import annotations

import asyncio
import time

from django.conf import settings

from inference.models import Deployment
from inference.spec import DeploymentSpec
from sluice.db import async_db

_cache: dict[str, tuple[float, DeploymentSpec | None]] = {}
_inflight: dict[str, asyncio.Future[DeploymentSpec | None]] = {}


def _load(name: str) -> DeploymentSpec | None:
    deployment = Deployment.objects.filter(name=name, enabled=True).first()
    return deployment.to_spec() if deployment is not None else None


async def enabled_spec(name: str) -> DeploymentSpec | None:
    now = time.monotonic()
    hit = _cache.get(name)
    if hit is not None and hit[0] > now:
        return hit[1]
    # When the entry expires under load, one lookup serves every waiting request.
    pending = _inflight.get(name)
    if pending is not None:
        return await asyncio.shield(pending)
    task = asyncio.ensure_future(async_db(_load)(name))
    _inflight[name] = task
    try:
        spec = await asyncio.shield(task)
    finally:
        _inflight.pop(name, None)
    ttl = float(getattr(settings, "SLUICE_REGISTRY_CACHE_TTL_S", 5))
    if len(_cache) > 10_000:
        _cache.clear()
    _cache[name] = (now + ttl, spec)
    return spec


def clear() -> None:
    _cache.clear()
