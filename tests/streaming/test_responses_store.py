"""Stored responses on the real database and Redis (streaming/apis/responses/copy.py,
streaming/apis/responses/writer.py): a save is readable from Redis as soon as its caller has
returned and from the database once the writer has run; the writer writes a busy
stream in one transaction, loses nothing when a writer dies before its commit, and drops a
row the database refuses without holding up the rest; an id stored again stores
nothing; a DELETE wins over a save it races (in Redis, at the writer's INSERT, during a
stream, before an idempotent retry), and only its creator's or an admin's does; what
Redis and the database keep is redacted; a `previous_response_id` chain is read in a
few queries however long, across Redis and the database, and ends at a link its reader
may not read."""

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
from django.db import connection
from django.test.utils import CaptureQueriesContext

from sluice import streamwriter
from sluice.errors import NotFound, PermissionDenied
from sluice.redis import async_redis, sync_redis
from sluice.redisdirect import Coalescer
from streaming.apis.responses import store as responses_store
from streaming.apis.responses import writer as responses_writer
from streaming.apis.responses.copy import STREAM, copy_key
from streaming.apis.responses.store import (
    response_context,
    response_create,
    response_delete,
    response_get,
    response_save,
)
from tenants.models import Member
from tenants.principal import Principal
from tenants.roles import Role
from tests.conftest import Org, eventually, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.cluster]


@pytest.fixture(autouse=True)
def _empty_stream() -> None:
    """The stream starts empty: what earlier tests left there names their (deleted)
    tenants, and the counts below are this test's rows."""
    sync_redis().delete(STREAM)


@pytest.fixture
def org() -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])


def dev_of(org: Org) -> Principal:
    return principal_for(org.members[Role.DEVELOPER])


def body(rid: str | None = None, *, text: str = "hi", model: str = "echo") -> dict[str, Any]:
    rid = rid or f"resp_{token_hex(12)}"
    return {"id": rid, "object": "response", "status": "completed", "model": model,
            "created_at": None, "usage": {"input_tokens": 1, "output_tokens": 1},
            "output": [{"id": f"msg_{token_hex(12)}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def save(actor: Principal, *bodies: dict[str, Any],
         items: list[dict[str, Any]] | None = None) -> None:
    """Save each of `bodies` as a gateway does, on a coalescer of its own (together)."""
    async def run() -> None:
        client = async_redis()
        scripts = Coalescer(client)
        try:
            await asyncio.gather(*(response_save(actor=actor, body=b, input_items=items or [],
                                                 scripts=scripts) for b in bodies))
        finally:
            await scripts.aclose()
            await client.aclose()

    asyncio.run(run())


def other_connection() -> psycopg.Connection[Any]:
    """A connection of its own to the test database (what another process would use)."""
    s = connection.settings_dict
    return psycopg.connect(dbname=s["NAME"], user=s["USER"], password=s["PASSWORD"] or None,
                           host=s["HOST"] or None, port=s["PORT"] or None, autocommit=True)


def stored_elsewhere(rid: str) -> bool:
    with other_connection() as other:
        return other.execute("SELECT 1 FROM streaming_storedresponse WHERE public_id = %s",
                             [rid]).fetchone() is not None


def xmins(rids: list[str]) -> set[str]:
    """The transactions that wrote `rids` (PostgreSQL's xmin: one per INSERT here)."""
    with other_connection() as other:
        return {row[0] for row in other.execute(
            "SELECT xmin::text FROM streaming_storedresponse WHERE public_id = ANY(%s)",
            [rids])}


def copied(org: Org, rid: str) -> bool:
    return bool(sync_redis().exists(copy_key(org.tenant.pk, rid)))


@contextmanager
def insert_held(org: Org, rid: str) -> Iterator[threading.Thread]:
    """A writer's batch stuck at its INSERT until the block ends: another transaction
    inserts (uncommitted) the id the batch writes, and the batch waits for it. Yields
    the thread that runs the batch."""
    holder = other_connection()
    holder.autocommit = False
    holder.execute(
        "INSERT INTO streaming_storedresponse (tenant_id, public_id, created_by, model, "
        "status, previous_response_id, input_items, output_items, details, created_at) "
        "VALUES (%s, %s, 'x', 'echo', 'completed', '', '[]', '[]', '{}', now())",
        [org.tenant.pk, rid])
    batch = threading.Thread(target=responses_writer.drain)
    batch.start()
    try:
        with other_connection() as watcher:
            eventually(lambda: watcher.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE 'INSERT%%'").fetchone(),
                30, what="the writer's INSERT waiting")
        yield batch
    finally:
        holder.rollback()  # the batch goes through (nothing conflicts any more)
        holder.close()
        batch.join(30)


# -- readable at once, from Redis then from the database ----------------------------------
def test_a_save_is_readable_at_once_and_in_the_database_after_the_writer(org: Org) -> None:
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    # Given a saved response (its caller has returned)
    save(dev, body(rid, text="kept"), items=[
        {"id": "msg_1", "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "asked"}]}])
    # Then it is readable before any writer ran (from Redis), and not in the database
    assert response_get(actor=dev, response_id=rid).output_items[0]["content"][0]["text"] \
        == "kept"
    assert copied(org, rid) and not stored_elsewhere(rid)
    # When the writer runs, Then it is in the database, its copy is gone, and it reads
    # the same
    assert responses_writer.drain() == 1
    assert stored_elsewhere(rid) and not copied(org, rid)
    row = response_get(actor=dev, response_id=rid)
    assert row.output_items[0]["content"][0]["text"] == "kept"
    assert row.input_items[0]["content"][0]["text"] == "asked"
    assert sync_redis().xlen(STREAM) == 0


def test_another_tenants_or_members_copy_is_not_found(org: Org) -> None:
    # Given a developer's response, in Redis only
    rid = f"resp_{token_hex(12)}"
    save(dev_of(org), body(rid))
    user = get_user_model().objects.create_user(username="alice-dev3", password="x" * 16)
    colleague = principal_for(Member.objects.create(tenant=org.tenant, user=user,
                                                    role=Role.DEVELOPER))
    bob = make_org("bob", [Role.TENANT_ADMIN])
    # Then another tenant's admin and a colleague get the missing-id 404, and neither's
    # DELETE removes it; an auditor may not read it; the tenant's admin may
    for who in (principal_for(bob.members[Role.TENANT_ADMIN]), colleague):
        with pytest.raises(NotFound):
            response_get(actor=who, response_id=rid)
        with pytest.raises(NotFound):
            response_delete(actor=who, response_id=rid)
    with pytest.raises(PermissionDenied):
        response_get(actor=principal_for(org.members[Role.AUDITOR]), response_id=rid)
    admin = principal_for(org.members[Role.TENANT_ADMIN])
    assert response_get(actor=admin, response_id=rid).public_id == rid
    responses_writer.drain()
    assert response_get(actor=dev_of(org), response_id=rid).public_id == rid


# -- the writer ---------------------------------------------------------------------------
def test_the_writer_writes_a_busy_stream_in_one_transaction(org: Org) -> None:
    # Given 40 saves made together
    dev = dev_of(org)
    rids = [f"resp_{token_hex(12)}" for _ in range(40)]
    # (each reply's text its id's number: a hex id may hold a Luhn-valid card number)
    save(dev, *(body(rid, text=f"reply {n}") for n, rid in enumerate(rids)))
    # When the writer runs, Then they are written in one transaction
    written = responses_writer.drain()
    assert (written, len(xmins(rids))) == (40, 1), sync_redis().xinfo_groups(STREAM)
    for n, rid in enumerate(rids):
        assert response_get(actor=dev, response_id=rid).output_items[0]["content"][0][
            "text"] == f"reply {n}"


def test_a_writer_that_died_before_its_commit_loses_nothing(org: Org) -> None:
    # Given saves that a writer took from the stream and died with (never acknowledged)
    rids = [f"resp_{token_hex(12)}" for _ in range(3)]
    save(dev_of(org), *(body(rid) for rid in rids))
    dead = responses_writer.Writer(name="dead")
    assert dead.redis.xreadgroup(streamwriter.GROUP, "dead", {STREAM: ">"}, count=10)
    # When another writer runs (past the claim delay), Then it writes them, once
    other = responses_writer.Writer(name="alive", claim_idle_ms=0)
    assert other.run_once(block_ms=50) == 3
    assert all(stored_elsewhere(rid) for rid in rids)
    assert sync_redis().xpending(STREAM, streamwriter.GROUP)["pending"] == 0
    # and the dead writer's name, restarted, finds nothing left to write
    assert responses_writer.Writer(name="dead").run_once(block_ms=50) == 0


def test_a_row_the_database_refuses_is_dropped_alone(org: Org) -> None:
    # Given saves of which one the database refuses (too long a model name)
    dev = dev_of(org)
    good = [f"resp_{token_hex(12)}" for _ in range(3)]
    bad = f"resp_{token_hex(12)}"
    save(dev, *(body(rid) for rid in good), body(bad, model="m" * 300))
    # When the writer runs, Then the others are written and nothing is left behind
    assert responses_writer.drain() == 4
    assert all(stored_elsewhere(rid) for rid in good) and not stored_elsewhere(bad)
    assert sync_redis().xlen(STREAM) == 0


def test_saving_a_stored_id_again_stores_nothing(org: Org) -> None:
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    save(dev, body(rid, text="first"))
    save(dev, body(rid, text="second"))
    assert response_get(actor=dev, response_id=rid).output_items[0]["content"][0][
        "text"] == "first"
    responses_writer.drain()
    save(dev, body(rid, text="third"))
    responses_writer.drain()
    with other_connection() as other:
        rows = other.execute("SELECT output_items->0->'content'->0->>'text' FROM "
                             "streaming_storedresponse WHERE public_id = %s", [rid]).fetchall()
    assert rows == [("first",)]


# -- a DELETE wins ------------------------------------------------------------------------
def test_a_delete_before_the_writer_ran_wins(org: Org) -> None:
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    save(dev, body(rid))
    assert response_delete(actor=dev, response_id=rid) == rid
    with pytest.raises(NotFound):
        response_get(actor=dev, response_id=rid)
    responses_writer.drain()
    assert not stored_elsewhere(rid)


def test_a_delete_while_the_writer_inserts_wins(org: Org) -> None:
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    save(dev, body(rid))
    # Given a writer's batch waiting at its INSERT of the response
    with insert_held(org, rid):
        # When its creator deletes it meanwhile (its copy is still there)
        assert response_delete(actor=dev, response_id=rid) == rid
    # Then once the INSERT went through, the response is gone all the same
    assert not stored_elsewhere(rid) and not copied(org, rid)
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
    responses_writer.drain()
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
    responses_writer.drain()
    assert not stored_elsewhere(first.id)


def test_a_retry_after_a_delete_stores_nothing(org: Org) -> None:
    # Given a stored response, deleted
    dev = dev_of(org)
    rid = f"resp_{token_hex(12)}"
    save(dev, body(rid))
    responses_writer.drain()
    assert response_delete(actor=dev, response_id=rid) == rid
    # When an idempotent retry of its call saves it again
    save(dev, body(rid))
    # Then it stays deleted, in Redis and in the database
    with pytest.raises(NotFound):
        response_get(actor=dev, response_id=rid)
    responses_writer.drain()
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
    save(dev, body(kept))
    assert response_get(actor=dev, response_id=kept).public_id == kept
    # But the tenant admin's DELETE wins over the developer's save
    gone = f"resp_{token_hex(12)}"
    with pytest.raises(NotFound):
        response_delete(actor=admin, response_id=gone)
    save(dev, body(gone))
    with pytest.raises(NotFound):
        response_get(actor=dev, response_id=gone)
    responses_writer.drain()
    assert stored_elsewhere(kept) and not stored_elsewhere(gone)


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
    # When they are saved, with a response object whose caller's text holds it too
    caller = {"instructions": f"Help {ssn}", "user": ssn, "prompt_cache_key": ssn,
              "safety_identifier": ssn, "metadata": {"who": ssn}}
    save(dev_of(org), {**body(rid, text=ssn), **caller}, items=items)
    # Then Redis's copy holds none of it raw, nor, once written, the row
    raw = sync_redis().hgetall(copy_key(org.tenant.pk, rid))
    assert raw and all(ssn.encode() not in v for v in raw.values())
    assert b"[SSN]" in raw[b"row"]
    assert all(ssn.encode() not in fields[b"row"] for _, fields in sync_redis().xrange(STREAM))
    responses_writer.drain()
    with other_connection() as other:
        row = other.execute("SELECT input_items::text, output_items::text, details::text "
                            "FROM streaming_storedresponse WHERE public_id = %s",
                            [rid]).fetchone()
    assert row is not None and ssn not in row[0] + row[1] + row[2]
    assert row[2].count("[SSN]") == len(caller)
    stored = response_get(actor=dev_of(org), response_id=rid).input_items
    assert [(i["id"], i["type"]) for i in stored] == [(i["id"], i["type"]) for i in items]
    assert stored[1]["name"] == stored[1]["call_id"] == "[SSN]"
    assert stored[0]["content"][0]["text"] == "I am [SSN]"


def test_a_nul_anywhere_in_the_response_object_is_stored_as_a_replacement(org: Org) -> None:
    # Given a response object with a NUL in fields nobody redacts (a tool's description,
    # a schema's) and none elsewhere
    rid, plain = f"resp_{token_hex(12)}", f"resp_{token_hex(12)}"
    tools = [{"type": "function", "name": "lookup", "description": "Looks\x00 up",
              "parameters": {"type": "object", "description": "\x00"}}]
    # When both are saved and written
    save(dev_of(org), {**body(rid), "tools": tools}, {**body(plain), "tools": []})
    responses_writer.drain()
    # Then PostgreSQL holds the first (jsonb has no NUL) with U+FFFD for each, the other as
    # it was
    stored = response_get(actor=dev_of(org), response_id=rid).details["tools"]
    assert stored[0]["description"] == "Looks\ufffd up"
    assert stored[0]["parameters"]["description"] == "\ufffd"
    assert response_get(actor=dev_of(org), response_id=plain).details["tools"] == []


def test_saves_are_refused_not_trimmed_while_the_writer_cannot_keep_up(
        live: Live, org: Org, settings: Any) -> None:
    """No writer runs here: once SLUICE_RESPONSES_REFUSE_AT rows wait in the stream, a
    call that asks to store gets a retriable 503 `store_unavailable` before it runs (the
    stream's bound would otherwise trim rows nobody wrote), store=false is still served,
    and once the rows are written storing works again."""
    settings.SLUICE_RESPONSES_REFUSE_AT = 3
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0, timeout=60)
    kept = [client.responses.create(model="echo", input=f"kept {i}").id for i in range(3)]
    # Given three rows waiting (the refusal reads the backlog at most once a second)
    def refused() -> openai.APIStatusError | None:
        try:
            client.responses.create(model="echo", input="one more")
        except openai.APIStatusError as exc:
            return exc
        return None

    refusal = eventually(refused, timeout=10)
    assert refusal.status_code == 503 and refusal.code == "store_unavailable", refusal
    assert refusal.response.headers["retry-after"] == "5"
    waiting = sync_redis().xlen(STREAM)
    assert client.responses.create(model="echo", input="unstored", store=False).output_text
    assert sync_redis().xlen(STREAM) == waiting, "a refused or unstored call was queued"
    # When the writer catches up, storing is served again; nothing kept was lost
    responses_writer.drain()
    assert eventually(lambda: refused() is None, timeout=10)
    assert all(stored_elsewhere(rid) for rid in kept)


# -- a previous_response_id's chain -------------------------------------------------------
def chained(actor: Principal, n: int, *, after: str | None = None, first: int = 0,
            in_redis: bool = False) -> list[str]:
    """`n` responses, each continuing the one before (the first `after`), created in the
    database or only saved to Redis; the k-th says `q<first + k>` and answers
    `a<first + k>`. Their ids, oldest first."""
    ids: list[str] = []
    for k in range(first, first + n):
        made = {**body(text=f"a{k}"), "previous_response_id": ids[-1] if ids else after}
        items = [{"type": "message", "role": "user", "content": f"q{k}"}]
        if in_redis:
            save(actor, made, items=items)
        else:
            response_create(actor=actor, body=made, input_items=items)
        ids.append(made["id"])
    return ids


def said(items: list[dict[str, Any]]) -> list[str]:
    """The text of each input and output item of a context, in order."""
    return [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"]
            for i in items]


def test_a_chain_is_read_in_a_few_queries_however_long(org: Org) -> None:
    dev = dev_of(org)
    short = chained(dev, 2)
    # Given a chain of 40 in the database whose newest two are still only in Redis
    written = chained(dev, 38)
    newest = chained(dev, 2, after=written[-1], first=38, in_redis=True)
    # When a call continues each
    with CaptureQueriesContext(connection) as few:
        response_context(actor=dev, response_id=short[-1])
    with CaptureQueriesContext(connection) as many:
        context = response_context(actor=dev, response_id=newest[-1])
    # Then the long chain cost the queries of the short one, and it came whole, in order
    assert len(many) == len(few) <= 4, [q["sql"] for q in many]
    assert said(context) == [t for k in range(40) for t in (f"q{k}", f"a{k}")]


def test_a_chain_ends_at_a_link_its_reader_may_not_read(org: Org) -> None:
    dev, admin = dev_of(org), principal_for(org.members[Role.TENANT_ADMIN])
    # Given the admin's chain of 3, then the developer's 3 continuing it
    theirs = chained(admin, 3)
    mine = chained(dev, 3, after=theirs[-1])
    # Then the developer's context stops at the admin's response; the admin, who may
    # read every member's, gets the whole chain
    assert said(response_context(actor=dev, response_id=mine[-1])) == [
        "q0", "a0", "q1", "a1", "q2", "a2"]
    assert len(response_context(actor=admin, response_id=mine[-1])) == 12
    # and a deleted link ends it there, in the database and in Redis alike
    response_delete(actor=dev, response_id=mine[1])
    assert said(response_context(actor=dev, response_id=mine[-1])) == ["q2", "a2"]
    copies = chained(dev, 3, after=mine[-1], in_redis=True)
    response_delete(actor=dev, response_id=copies[0])
    assert len(response_context(actor=dev, response_id=copies[-1])) == 4


def test_a_chain_is_followed_back_max_chain_responses_at_most(
        org: Org, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = dev_of(org)
    ids = chained(dev, 12)
    monkeypatch.setattr(responses_store, "MAX_CHAIN", 5)
    assert said(response_context(actor=dev, response_id=ids[-1]))[::2] == [
        f"q{k}" for k in range(7, 12)]
