"""The autoscaler's decisions through the management API: the decide-only driver (what
Kubernetes/KEDA follows) against a real queue holding a real request."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings

from inference import autoscaler
from inference.client import InferenceClient
from inference.jobs import ChatJob
from inference.models import Deployment
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.cluster]


@pytest.fixture(autouse=True)
def _empty_redis() -> None:
    sync_client(settings.REDIS_URL).flushdb()  # no state, events or lease left


def test_a_waiting_request_is_a_decision_with_its_reason(ops: Org) -> None:
    spec = Deployment.objects.create(name="lazy", runtime="echo", min_replicas=0,
                                     max_replicas=4, target_inflight=2).to_spec()

    async def enqueue() -> None:
        client = InferenceClient(settings.REDIS_URL)
        for _ in range(3):
            await client.submit(spec, tenant="t", job=ChatJob(messages=[]), timeout_s=60)
        await client.close()

    asyncio.run(enqueue())
    rds = sync_client(settings.REDIS_URL)
    scaler = autoscaler.Autoscaler(rds, settings.REDIS_URL, driver="none", only=["lazy"])
    scaler.tick()
    body = ops.client(Role.PLATFORM_ADMIN).get("/api/v1/deployments/lazy/scaling").body
    assert body["desired"] == 2 and body["running"] == 0 and body["live_workers"] == 0
    assert body["depth"] == 3 and body["driver"] == "none"
    event = body["events"][0]
    assert (event["kind"], event["from_replicas"], event["to_replicas"]) == ("scale", 0, 2)
    assert "3 request(s) waiting with no worker" in event["reason"]
    # A second autoscaler stands by while the first holds the lease.
    standby = autoscaler.Autoscaler(rds, settings.REDIS_URL, driver="none", only=["lazy"])
    standby.tick()
    assert not standby.leader and scaler.leader


def test_scaling_is_for_platform_admins(ops: Org, alice: Org) -> None:
    Deployment.objects.create(name="lazy", runtime="echo")
    assert_openai_error(alice.client(Role.TENANT_ADMIN).get("/api/v1/deployments/lazy/scaling"),
                        403)
    body = ops.client(Role.PLATFORM_ADMIN).get("/api/v1/deployments/lazy/scaling").body
    assert body["desired"] is None and body["events"] == []
