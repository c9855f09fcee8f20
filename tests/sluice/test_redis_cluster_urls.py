"""Cluster URLs and settings (sluice.redis, settings/redis.py): what a redis+cluster://
URL may hold, what is refused at start-up and how, and a cluster that cannot be reached
failing as the retriable redis.ConnectionError every caller handles. No cluster needed:
the unreachable one is a closed port."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import redis

from sluice.localinfra import free_port
from sluice.redis import (
    AsyncCluster,
    ClusterUnavailable,
    async_client,
    cluster_seeds,
    is_cluster_url,
    sync_client,
)
from tests.conftest import REPO


def test_a_cluster_url_names_its_seed_nodes() -> None:
    seeds = cluster_seeds("redis+cluster://u:p%40ss@10.0.0.1:7000,redis-b:7001, [::1]:7002/")
    assert seeds.nodes == (("10.0.0.1", 7000), ("redis-b", 7001), ("::1", 7002))
    assert seeds.node_url == "redis://u:p%40ss@10.0.0.1:7000/0"
    tls = cluster_seeds("rediss+cluster://h1,h2:6380/0?ssl_cert_reqs=required")
    assert tls.nodes == (("h1", 6379), ("h2", 6380))
    assert tls.node_url == "rediss://h1:6379/0?ssl_cert_reqs=required"
    assert is_cluster_url("REDIS+CLUSTER://h:1/") and not is_cluster_url("redis://h:1/0")


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+cluster:///", "at least one node"),
    ("redis+cluster://h:7000/3", "only database 0"),
    ("redis+cluster://h:0/", "port 1..65535"),
    ("redis+cluster://h:70000/", "port 1..65535"),
    ("redis+cluster://h:port/", "not a number"),
    ("redis://h:7000/0", "starts with redis+cluster://"),
])
def test_a_malformed_cluster_url_is_refused_without_its_password(url: str, problem: str
                                                                  ) -> None:
    url = url.replace("://", "://admin:hunter2secret@", 1)
    with pytest.raises(ValueError, match=re.escape(problem)) as refused:
        cluster_seeds(url)
    assert "hunter2secret" not in str(refused.value)


def _settings_say(env: dict[str, str]) -> str:
    """What loading the settings in a fresh process prints, or its last error line."""
    code = ("import django; from django.conf import settings; django.setup(); "
            "print('loaded', settings.REDIS_IS_CLUSTER, settings.CELERY_REDIS_URL, "
            "settings.CHANNELS_REDIS_URL)")
    base = {k: v for k, v in os.environ.items()
            if k not in ("SLUICE_CELERY_REDIS_URL", "SLUICE_CHANNELS_REDIS_URL")}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**base, "DJANGO_SETTINGS_MODULE": "sluice.settings.base", **env})
    return run.stdout if run.returncode == 0 else run.stderr.strip().splitlines()[-1]


def test_a_cluster_redis_url_needs_a_single_redis_for_celery_and_channels() -> None:
    cluster = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/"
    single = "redis://127.0.0.1:6379/10"
    assert "set SLUICE_CELERY_REDIS_URL" in _settings_say({"REDIS_URL": cluster})
    assert "must be a single Redis" in _settings_say(
        {"REDIS_URL": cluster, "SLUICE_CELERY_REDIS_URL": cluster})
    assert "only database 0" in _settings_say({"REDIS_URL": "redis+cluster://h:1/2"})
    assert _settings_say({"REDIS_URL": cluster, "SLUICE_CELERY_REDIS_URL": single}) \
        == f"loaded True {single} {single}\n"
    # A single Redis serves them all, as before.
    assert _settings_say({"REDIS_URL": single}) == f"loaded False {single} {single}\n"


def test_an_unreachable_cluster_fails_as_a_retriable_connection_error(settings: Any) -> None:
    """No seed answers: the sync client (which reads the topology when built) and the
    asyncio one (at its first command) raise ClusterUnavailable, a redis.ConnectionError,
    not redis-py's RedisClusterException, which no caller of ours handles."""
    settings.REDIS_CLUSTER_RETRY_S = 0.1
    url = f"redis+cluster://127.0.0.1:{free_port()}/"
    with pytest.raises(ClusterUnavailable) as sync_refused:
        sync_client(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    assert isinstance(sync_refused.value, redis.ConnectionError)

    async def first_command() -> None:
        client = async_client(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        assert isinstance(client, AsyncCluster)
        try:
            with pytest.raises(redis.ConnectionError):
                await client.get("sluice:{t}:x")
            with pytest.raises(redis.ConnectionError):
                pipe = client.pipeline(transaction=False)
                pipe.get("sluice:{t}:x")
                await pipe.execute()
        finally:
            await client.aclose()

    asyncio.run(first_command())
