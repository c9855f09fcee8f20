"""Governance tests run the real Redis scripts on the test Redis (a clean database per
test); tests that need time to pass either drive the scripts' clock argument (the
gateway never sends one: Redis' TIME decides) or wait for real."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from django.conf import settings

from governance import cache as policy_cache
from sluice.redis import sync_client
from tests.streaming.conftest import grpc_target, live, tiny  # noqa: F401 - live server fixtures


@pytest.fixture
def rds() -> Iterator[redis.Redis]:
    client = sync_client(settings.REDIS_URL)
    client.flushdb()
    policy_cache.clear()
    yield client
    client.close()
