"""Governance tests run the real Redis scripts on the test Redis (a clean database per
test); tests that need time to pass either drive the scripts' clock argument (the
gateway never sends one: Redis' TIME decides) or wait for real."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from django.conf import settings

from governance import cache as policy_cache
from governance.models import Price
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live, grpc_target, live, roomy, tiny  # noqa: F401 - live server fixtures


@pytest.fixture
def rds() -> Iterator[redis.Redis]:
    client = sync_client(settings.REDIS_URL)
    client.flushdb()
    policy_cache.clear()
    yield client
    client.close()


@pytest.fixture
def payer(live: Live) -> Org:  # noqa: F811 (the fixture imported above)
    """A tenant (admin and developer) on a live server where echo costs $1,000 per
    million tokens in and out: a short call costs a few cents."""
    Price.objects.create(model="echo", input_per_mtok_usd=1000, output_per_mtok_usd=1000,
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    org = make_org("payer", [Role.TENANT_ADMIN, Role.DEVELOPER])
    policy_cache.clear()
    return org
