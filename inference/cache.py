"""Deployment specs for the hot path, cached in-process for a few seconds so that the
lean /v1 path does not read the registry per request. An edit reaches every gateway
process within SLUICE_REGISTRY_CACHE_TTL_S (default 5 s)."""

from __future__ import annotations

from django.conf import settings

from inference.models import Deployment
from inference.spec import DeploymentSpec
from sluice.db import async_db
from sluice.ttlcache import AsyncTTLCache

_cache: AsyncTTLCache[str, DeploymentSpec | None] = AsyncTTLCache(max_entries=10_000)


def _load(name: str) -> DeploymentSpec | None:
    deployment = Deployment.objects.filter(name=name, enabled=True).first()
    return deployment.to_spec() if deployment is not None else None


async def enabled_spec(name: str) -> DeploymentSpec | None:
    return await _cache.get(name, lambda: async_db(_load)(name),
                            float(settings.SLUICE_REGISTRY_CACHE_TTL_S))


def clear() -> None:
    _cache.clear()
