"""Liveness and readiness probes against the real database and Redis."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

import sluice.redis
from sluice.localinfra import free_port
from tenants import apikeys
from tests.conftest import ApiClient, gateway_process, process_env

pytestmark = [pytest.mark.django_db, pytest.mark.cluster]


def test_healthz_is_ok_without_auth(anon: ApiClient) -> None:
    assert anon.get("/healthz").body == {"status": "ok"}


def test_readyz_checks_database_and_redis(anon: ApiClient) -> None:
    response = anon.get("/readyz")
    assert response.status == 200
    assert response.body == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}


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


@pytest.mark.slow
def test_a_database_that_does_not_answer_leaves_the_gateway_ready_and_callers_not_hanging(
) -> None:
    """A gateway whose PostgreSQL accepts connections and never answers (a blackholed
    failover): its probe says `degraded` at once and stays 200, so its load balancer
    keeps it; a caller that needs the database gets the retriable 503 after the connect
    timeout (2 s here) instead of the kernel's two minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes handshakes; nobody ever reads
        host, port = silent.getsockname()
        env = process_env(SLUICE_DB_CONNECT_TIMEOUT_S="2")
        env["DATABASE_URL"] = f"postgresql://sluice@{host}:{port}/sluice"
        with gateway_process(env) as (_proc, base):
            started = time.monotonic()
            ready = httpx.get(f"{base}/readyz", timeout=10)
            assert time.monotonic() - started < 1.5
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"status": "degraded",
                                    "checks": {"database": "timeout", "redis": "ok"}}
            started = time.monotonic()
            chat = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {apikeys.generate()[0]}"},
                              json={"model": "echo",
                                    "messages": [{"role": "user", "content": "hi"}]})
            took = time.monotonic() - started
            assert chat.status_code == 503, chat.text
            assert chat.json()["error"]["code"] == "database_unavailable"
            assert chat.headers["retry-after"] == "1"
            assert 1.5 < took < 10, took
            # The probe's own check has failed by now: it says so, still ready.
            time.sleep(2)
            again = httpx.get(f"{base}/readyz", timeout=10).json()
            assert again["status"] == "degraded"
            assert again["checks"]["database"] in ("error: OperationalError", "timeout")
