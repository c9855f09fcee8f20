"""Stored responses written together (streaming/responses_writer.py) on the real
database and Redis: the saves that arrive while the writer is busy share one INSERT and
each is readable from another connection as soon as its caller has returned; a bad row
fails its own save only; an id stored again stores nothing; a DELETE wins over a save
it races (at the database, during a stream, before an idempotent retry), and only its
creator's or an admin's does."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from secrets import token_hex
from typing import Any

import openai
import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import DataError, connection

from sluice.errors import NotFound
from streaming import responses_writer
from streaming.models import StoredResponse
from streaming.responses_store import response_delete, response_get, response_save
from tenants.models import Member
from tenants.principal import Principal
from tenants.roles import Role
from tests.conftest import Org, eventually, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def org() -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])


def dev_of(org: Org) -> Principal:
    return principal_for(org.members[Role.DEVELOPER])


def body(rid: str | None = None, *, text: str = "hi", model: str = "echo") -> dict[str, Any]:
    rid = rid or f"resp_{token_hex(12)}"
    return {"id": rid, "object": "response", "status": "completed", "model": model,
            "created_at": None, "usage": {"input_tokens": 1, "output_tokens": 1},
            "output": [{"id": f"msg_{token_hex(12)}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def other_connection() -> psycopg.Connection[Any]:
    """A connection of its own to the test database (what another process would use)."""
    s = connection.settings_dict
    return psycopg.connect(dbname=s["NAME"], user=s["USER"], password=s["PASSWORD"] or None,
                           host=s["HOST"] or None, port=s["PORT"] or None, autocommit=True)


def stored_elsewhere(rid: str) -> bool:
    with other_connection() as other:
        return other.execute("SELECT 1 FROM streaming_storedresponse WHERE public_id = %s",
                             [rid]).fetchone() is not None


@contextmanager
def writer_held(org: Org) -> Iterator[str]:
    """The writer thread stuck on an INSERT until the block ends: another transaction
    inserts (uncommitted) the id a first save then writes; that save waits for it. The
    saves made meanwhile queue behind it. Yields that first id."""
    rid = f"resp_{token_hex(12)}"
    holder = other_connection()
    holder.autocommit = False
    holder.execute(
        "INSERT INTO streaming_storedresponse (tenant_id, public_id, created_by, model, "
        "status, previous_response_id, input_items, output_items, details, created_at) "
        "VALUES (%s, %s, 'x', 'echo', 'completed', '', '[]', '[]', '{}', now())",
        [org.tenant.pk, rid])
    first = threading.Thread(target=asyncio.run, args=(
        response_save(actor=dev_of(org), body=body(rid), input_items=[]),))
    first.start()
    try:
        with other_connection() as watcher:
            eventually(lambda: watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE 'INSERT%%'").fetchone(),
                30, what="the writer's INSERT waiting")
        yield rid
    finally:
        holder.rollback()  # the first save goes through (nothing conflicts any more)
        holder.close()
        first.join(30)


def xmins(rids: list[str]) -> set[str]:
    """The transactions that wrote `rids` (PostgreSQL's xmin: one per INSERT here)."""
    with other_connection() as other:
        return {row[0] for row in other.execute(
            "SELECT xmin::text FROM streaming_storedresponse WHERE public_id = ANY(%s)",
            [rids])}


# -- one INSERT for the saves of a busy moment -----------------------------------------
def test_saves_made_while_the_writer_is_busy_share_one_insert_and_are_readable_at_once(
        org: Org) -> None:
    dev = dev_of(org)
    rids = [f"resp_{token_hex(12)}" for _ in range(8)]
    seen: dict[str, bool] = {}

    async def save_then_read(rid: str) -> None:
        await response_save(actor=dev, body=body(rid, text=rid), input_items=[
            {"id": f"msg_{token_hex(12)}", "type": "message", "role": "user",
             "status": "completed", "content": [{"type": "input_text", "text": rid}]}])
        # the caller has returned: another connection (another process) sees the row
        seen[rid] = await asyncio.to_thread(stored_elsewhere, rid)

    async def saves() -> None:
        # Given a writer busy with a first INSERT
        tasks = [asyncio.create_task(save_then_read(rid)) for rid in rids]
        # When 8 saves queue behind it
        await asyncio.to_thread(eventually, lambda: responses_writer.pending() == 8, 30,
                                what="8 queued saves")
        release.set()
        await asyncio.gather(*tasks)

    release = threading.Event()
    with writer_held(org) as first:
        runner = threading.Thread(target=asyncio.run, args=(saves(),))
        runner.start()
        assert release.wait(60)
    runner.join(60)
    # Then they left as one INSERT (one transaction), apart from the first one's
    assert seen == dict.fromkeys(rids, True)
    assert len(xmins(rids)) == 1 and xmins(rids) != xmins([first])
    # and each is the response it was saved as
    for rid in rids:
        row = response_get(actor=dev, response_id=rid)
        assert row.output_items[0]["content"][0]["text"] == rid
        assert row.input_items[0]["content"][0]["text"] == rid


def test_a_lone_save_is_written_without_waiting_for_company(org: Org) -> None:
    rid = f"resp_{token_hex(12)}"
    asyncio.run(response_save(actor=dev_of(org), body=body(rid), input_items=[]))
    assert stored_elsewhere(rid)
    assert responses_writer.pending() == 0


def test_a_bad_row_fails_its_own_save_only(org: Org) -> None:
    # Given saves made together, one of a row the database refuses (too long a model name)
    dev = dev_of(org)
    good = [f"resp_{token_hex(12)}" for _ in range(3)]
    bad = f"resp_{token_hex(12)}"

    async def saves() -> list[Any]:
        return await asyncio.gather(
            *(response_save(actor=dev, body=body(rid), input_items=[]) for rid in good),
            response_save(actor=dev, body=body(bad, model="m" * 300), input_items=[]),
            return_exceptions=True)

    outcomes = asyncio.run(saves())
    # Then that save alone failed, and the others are stored
    assert outcomes[:3] == [None, None, None]
    assert isinstance(outcomes[3], DataError)
    assert set(StoredResponse.objects.values_list("public_id", flat=True)) == set(good)


def test_saving_a_stored_id_again_stores_nothing(org: Org) -> None:
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    asyncio.run(response_save(actor=dev, body=body(rid, text="first"), input_items=[]))
    asyncio.run(response_save(actor=dev, body=body(rid, text="second"), input_items=[]))
    [row] = StoredResponse.objects.filter(public_id=rid)
    assert row.output_items[0]["content"][0]["text"] == "first"


# -- a DELETE wins ------------------------------------------------------------------------
def test_a_delete_while_the_insert_is_pending_wins(org: Org) -> None:
    dev = dev_of(org)
    # Given a save whose INSERT is waiting at the database
    # When its creator deletes it meanwhile (a stream's id is known from its first
    # event): nothing is stored yet, so it is the missing-id 404
    with writer_held(org) as rid, pytest.raises(NotFound):
        response_delete(actor=dev, response_id=rid)
    # Then once the INSERT went through, the response is gone all the same
    assert not stored_elsewhere(rid)
    with pytest.raises(NotFound):
        response_get(actor=dev, response_id=rid)


def test_a_delete_during_a_stream_wins_over_its_save(live: Live, org: Org) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0, timeout=60)
    # Given a stream whose id the client has from its first event (a 5 s reply: 100
    # tokens 50 ms apart, time enough for the DELETE on a loaded machine)
    events = iter(client.responses.create(model="slow-echo", input="x" * 100, stream=True))
    created = next(events)
    assert created.type == "response.created"
    # When the client deletes it before it ends: nothing is stored yet (a 404)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.response.id)
    # Then the stream completes, and what it saved at its end is gone all the same
    assert [e.type for e in events][-1] == "response.completed"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.response.id)
    assert not stored_elsewhere(created.response.id)


def test_a_call_retried_after_its_delete_stays_deleted(live: Live, org: Org) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0, timeout=60)
    # Given a plain call with an Idempotency-Key, stored, then deleted
    key = {"Idempotency-Key": "order-7"}
    first = client.responses.create(model="echo", input="once", extra_headers=key)
    client.responses.delete(first.id)
    # When the call is retried with its key (the first response's events again)
    again = client.responses.create(model="echo", input="once", extra_headers=key)
    # Then it answers the same response, which stays deleted
    assert again.id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_save_whose_id_nobody_was_given_is_not_looked_up(org: Org) -> None:
    # A plain call's id is first given out with its reply, after its save: a DELETE
    # naming it earlier can only be a guess of another call's id, and is not looked up
    rid = f"resp_{token_hex(12)}"
    with pytest.raises(NotFound):
        response_delete(actor=principal_for(org.members[Role.TENANT_ADMIN]), response_id=rid)
    asyncio.run(response_save(actor=dev_of(org), body=body(rid), input_items=[],
                              announced=False))
    assert stored_elsewhere(rid)


def test_a_retry_after_a_delete_stores_nothing(org: Org) -> None:
    # Given a stored response, deleted
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    asyncio.run(response_save(actor=dev, body=body(rid), input_items=[]))
    assert response_delete(actor=dev, response_id=rid) == rid
    # When an idempotent retry of its call saves it again
    asyncio.run(response_save(actor=dev, body=body(rid), input_items=[]))
    # Then it stays deleted
    assert not stored_elsewhere(rid)


def test_only_the_creators_or_an_admins_delete_stops_a_save(org: Org) -> None:
    dev = dev_of(org)
    user = get_user_model().objects.create_user(username="alice-dev2", password="x" * 16)
    colleague = principal_for(Member.objects.create(tenant=org.tenant, user=user,
                                                    role=Role.DEVELOPER))
    bob = make_org("bob", [Role.TENANT_ADMIN])
    outsider = principal_for(bob.members[Role.TENANT_ADMIN])
    admin = principal_for(org.members[Role.TENANT_ADMIN])
    # Given a colleague's and another tenant's admin's DELETE of an id not stored yet
    kept = f"resp_{token_hex(12)}"
    for who in (colleague, outsider):
        with pytest.raises(NotFound):
            response_delete(actor=who, response_id=kept)
    # When the developer's save of it comes, Then it is stored
    asyncio.run(response_save(actor=dev, body=body(kept), input_items=[]))
    assert response_get(actor=dev, response_id=kept).public_id == kept
    # But the tenant admin's DELETE wins over the developer's save
    gone = f"resp_{token_hex(12)}"
    with pytest.raises(NotFound):
        response_delete(actor=admin, response_id=gone)
    asyncio.run(response_save(actor=dev, body=body(gone), input_items=[]))
    assert not stored_elsewhere(gone)


# -- redaction before the write ------------------------------------------------------------
def test_every_field_of_the_callers_is_redacted_before_the_write(org: Org) -> None:
    # Given items whose every field a caller sets holds an SSN (ids and types are ours)
    ssn = "536-42-7151"
    rid = f"resp_{token_hex(12)}"
    items: list[dict[str, Any]] = [
        {"id": "msg_1", "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": f"I am {ssn}"}]},
        {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": ssn,
         "name": ssn, "arguments": f'{{"ssn": "{ssn}"}}'},
        {"id": "fco_1", "type": "function_call_output", "status": "completed",
         "call_id": ssn, "output": f"found {ssn}"},
    ]
    # When they are saved
    asyncio.run(response_save(actor=dev_of(org), body=body(rid, text=ssn), input_items=items))
    # Then the row holds none of it raw, and the rest as it was
    with other_connection() as other:
        row = other.execute("SELECT input_items::text, output_items::text FROM "
                            "streaming_storedresponse WHERE public_id = %s", [rid]).fetchone()
    assert row is not None and ssn not in row[0] + row[1]
    stored = response_get(actor=dev_of(org), response_id=rid).input_items
    assert [(i["id"], i["type"]) for i in stored] == [(i["id"], i["type"]) for i in items]
    assert stored[1]["name"] == stored[1]["call_id"] == "[SSN]"
    assert stored[0]["content"][0]["text"] == "I am [SSN]"
