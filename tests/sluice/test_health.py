"""Liveness and readiness probes against the real database and Redis."""

from __future__ import annotations

from typing import Any

import pytest

import sluice.redis
from sluice.localinfra import free_port
from tests.conftest import ApiClient

pytestmark = pytest.mark.django_db


def test_healthz_is_ok_without_auth(anon: ApiClient) -> None:
    assert anon.get("/healthz").body == {"status": "ok"}


def test_readyz_checks_database_and_redis(anon: ApiClient) -> None:
    response = anon.get("/readyz")
    assert response.status == 200
    assert response.body["checks"] == {"database": "ok", "redis": "ok"}


def test_readyz_is_503_naming_redis_when_redis_is_gone(
    anon: ApiClient, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.REDIS_URL = f"redis://:s3cret-pass@127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(sluice.redis, "_sync", None)
    response = anon.get("/readyz")
    assert response.status == 503
    assert response.body["checks"]["database"] == "ok"
    assert response.body["checks"]["redis"].startswith("error")
    assert "s3cret" not in str(response.body), "credentials must not leak into the probe"
    monkeypatch.setattr(sluice.redis, "_sync", None)  # drop the broken client
