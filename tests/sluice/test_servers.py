"""How many HTTP processes the run command starts, and whom they believe forwarded
headers from (sluice/servers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice import servers
from sluice.redis import sync_redis
from tenants import throttle
from tenants.roles import Role
from tests.conftest import gateway_process, make_org, process_env


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (3, 3), (16, 4), (None, 1)])
def test_one_http_process_per_core_up_to_the_cap(monkeypatch: pytest.MonkeyPatch,
                                                 cores: int | None, expected: int) -> None:
    monkeypatch.delenv("SLUICE_HTTP_WORKERS", raising=False)
    monkeypatch.setattr(servers.os, "cpu_count", lambda: cores)
    assert servers.default_workers() == expected
    assert servers.default_workers("granian") == expected


def test_daphne_runs_one_and_the_setting_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_HTTP_WORKERS", raising=False)
    monkeypatch.setattr(servers.os, "cpu_count", lambda: 8)
    assert servers.default_workers("daphne") == 1
    command = servers.http_command("daphne", "app:app", host="127.0.0.1", port=1,
                                   workers=servers.default_workers("daphne"))
    assert "daphne" in " ".join(command)
    monkeypatch.setenv("SLUICE_HTTP_WORKERS", "3")
    assert servers.default_workers() == 3


def test_forwarded_headers_are_believed_from_the_configured_proxies_only() -> None:
    uvicorn = servers.http_command("uvicorn", "app:app", host="127.0.0.1", port=1,
                                   trusted_proxies=[])
    assert "--no-proxy-headers" in uvicorn and "--forwarded-allow-ips" not in uvicorn
    trusting = servers.http_command("uvicorn", "app:app", host="127.0.0.1", port=1,
                                    trusted_proxies=["10.1.2.3/8", "::1"])
    allowed = trusting[trusting.index("--forwarded-allow-ips") + 1]
    assert allowed == "10.0.0.0/8,::1/128"  # host bits dropped: uvicorn reads networks
    for server in ("daphne", "granian"):  # daphne's would believe any peer
        command = servers.http_command(server, "app:app", host="127.0.0.1", port=1,
                                       trusted_proxies=["10.0.0.0/8"])
        assert not any("proxy" in part or "forwarded" in part for part in command)


THRESHOLD = 3


@pytest.fixture
def guessed_keys(transactional_db: None) -> Iterator[list[str]]:
    """Wrong secrets of a real key's prefix; every counter and lock is forgotten before
    and after (all these clients are 127.0.0.1, other tests' too)."""
    def forget() -> None:
        for key in list(sync_redis().scan_iter("sluice:auth:*")):
            if key != b"sluice:auth:epoch":
                sync_redis().delete(key)
        throttle.clear()

    forget()
    prefix = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER].split("-")[2]
    yield [f"sk-sluice-{prefix}-GUESSEDSECRET{i:04d}" for i in range(THRESHOLD + 2)]
    forget()


@pytest.mark.slow
@pytest.mark.parametrize(("server", "trusted"), [
    ("uvicorn", ""), ("daphne", ""), ("uvicorn", "127.0.0.1/32")])
def test_a_rotating_forwarded_for_changes_the_source_only_from_a_trusted_proxy(
        guessed_keys: list[str], settings: Any, server: str, trusted: str) -> None:
    # Given the run command's server, trusting the loopback proxy or no proxy at all
    settings.SLUICE_TRUSTED_PROXIES = [trusted] if trusted else []
    env = process_env(SLUICE_TRUSTED_PROXIES=trusted,
                      SLUICE_AUTH_SOURCE_FAILURES=str(THRESHOLD),
                      SLUICE_AUTH_BACKOFF_S="30", SLUICE_AUTH_BACKOFF_MAX_S="30")
    with gateway_process(env, server=server) as (_, base):
        # When wrong keys come from 127.0.0.1, each claiming another X-Forwarded-For,
        # on the lean /v1 path and on Django's
        statuses = []
        for i, key in enumerate(guessed_keys):
            path = "/v1/chat/completions" if i % 2 else "/v1/models"
            statuses.append(httpx.request(
                "POST" if i % 2 else "GET", base + path, json={}, timeout=30,
                headers={"Authorization": f"Bearer {key}",
                         "X-Forwarded-For": f"203.0.113.{i + 1}"}).status_code)
    # Then untrusted, they count against the one peer and it is locked; trusted, each
    # is a source of its own
    if trusted:
        assert statuses == [401] * len(guessed_keys)
    else:
        assert statuses == [401] * (THRESHOLD - 1) + [429] * 3
