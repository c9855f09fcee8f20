"""Stored responses on a Redis Cluster (3 masters, started here): a copy lives in its
tenant's slot and the writer's stream in another, so a save is two scripts; the copies
are readable at once, a DELETE wins over a save still in the stream, and the writer
moves the rest into the database and drops their copies."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from secrets import token_hex
from typing import Any

import pytest

from sluice import redis as sluice_redis
from sluice.errors import NotFound
from sluice.localinfra import StartedCluster, start_redis_cluster
from sluice.redis import async_client, sync_client
from sluice.redisdirect import Coalescer
from streaming.apis.responses import writer as responses_writer
from streaming.apis.responses.copy import STREAM, copy_key
from streaming.apis.responses.store import response_delete, response_get, response_save
from streaming.models import StoredResponse
from tenants.roles import Role
from tests.conftest import Org, make_org, principal_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.cluster]


@pytest.fixture
def cluster(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[StartedCluster]:
    """A cluster, and this process's Redis client (settings.REDIS_URL) pointed at it."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed: no Redis Cluster to run")
    started = start_redis_cluster(masters=3, replicas=0)
    try:
        settings.REDIS_URL = started.url
        monkeypatch.setattr(sluice_redis, "_sync", sync_client(started.url))
        yield started
    finally:
        started.stop()


def body(rid: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": "completed", "model": "echo",
            "created_at": None, "usage": None,
            "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": rid, "annotations": []}]}]}


def test_saves_reads_deletes_and_writes_on_a_cluster(cluster: StartedCluster) -> None:
    org: Org = make_org("alice", [Role.DEVELOPER])
    dev = principal_for(org.members[Role.DEVELOPER])
    rids = [f"resp_{token_hex(12)}" for _ in range(4)]

    async def save_all() -> None:
        client = async_client(cluster.url)
        scripts = Coalescer(client)
        try:
            await asyncio.gather(*(response_save(actor=dev, body=body(rid), input_items=[],
                                                 scripts=scripts) for rid in rids))
        finally:
            await scripts.aclose()
            await client.aclose()

    # Given four saves on the cluster
    asyncio.run(save_all())
    rds = sluice_redis.sync_redis()
    assert rds.xlen(STREAM) == 4
    # Then each is readable at once, and a DELETE of one wins over its queued save
    for rid in rids:
        assert response_get(actor=dev, response_id=rid).output_items[0]["content"][0][
            "text"] == rid
    assert response_delete(actor=dev, response_id=rids[0]) == rids[0]
    with pytest.raises(NotFound):
        response_get(actor=dev, response_id=rids[0])
    # When the writer runs, Then the others are in the database and no copy is left
    assert responses_writer.drain() == 4
    assert set(StoredResponse.objects.values_list("public_id", flat=True)) == set(rids[1:])
    assert not any(rds.exists(copy_key(org.tenant.pk, rid)) for rid in rids)
    assert response_get(actor=dev, response_id=rids[1]).public_id == rids[1]
