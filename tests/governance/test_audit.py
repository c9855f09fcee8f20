"""The audit log: events for admin actions and API calls, hash chains that catch
tampering, append-only storage, retention that keeps chains verifiable, the auditor's
API, and exports made by a real Celery worker."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from governance import audit
from governance import cache as policy_cache
from governance.models import AuditChain, AuditEvent, AuditExport
from tenants.roles import Role
from tests.conftest import Org, make_org, principal_for
from tests.streaming.conftest import Live

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.cluster]


def events(chain: str) -> list[AuditEvent]:
    audit.drain()
    return list(AuditEvent.objects.filter(chain=chain).order_by("seq"))


def put(chain_org: Org, n: int, **extra: Any) -> None:
    principal = principal_for(chain_org.members[Role.TENANT_ADMIN])
    for i in range(n):
        audit.record_call(principal=principal, action="chat.completions", model="echo",
                          protocol="rest", status=200, latency_ms=i,
                          request_text=f"call {i}", **extra)
    audit.drain()


@pytest.fixture
def org(db: None) -> Org:
    return make_org("acme", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])


def test_admin_actions_are_recorded_on_commit(org: Org) -> None:
    admin = org.client(Role.TENANT_ADMIN)
    made = admin.post("/api/v1/keys", {"name": "ci key"})
    assert made.status == 201
    rows = [e for e in events("acme") if e.action == "apikey.create"]
    assert rows and rows[-1].target.startswith("apikey:")
    assert rows[-1].actor == principal_for(org.members[Role.TENANT_ADMIN]).subject
    assert rows[-1].protocol == "admin" and rows[-1].status == 200
    failed = admin.post("/api/v1/keys", {"name": "x", "role": "platform_admin"})
    assert failed.status == 403
    assert not [e for e in events("acme") if e.detail.get("role") == "platform_admin"]


def test_chain_verifies_and_tampering_is_found_at_that_event(org: Org) -> None:
    put(org, 6)
    assert audit.verify("acme") == []
    out = StringIO()
    call_command("verifyaudit", "--chain", "acme", stdout=out)
    assert "ok: 1 chains" in out.getvalue()
    victim = events("acme")[3]
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # the trigger refuses; an attacker with
            cursor.execute("SET LOCAL session_replication_role = replica")  # superuser
        cursor.execute("UPDATE governance_auditevent SET status = 500 WHERE id = %s",
                       [victim.pk])
    problems = audit.verify("acme")
    assert [(p.seq, p.event_id) for p in problems] == [(victim.seq, victim.pk)]
    assert "altered" in problems[0].reason
    err = StringIO()
    with pytest.raises(CommandError):
        call_command("verifyaudit", "--chain", "acme", stderr=err)
    assert f"event seq {victim.seq} (id {victim.pk})" in err.getvalue()


def test_a_removed_event_breaks_the_chain(org: Org) -> None:
    put(org, 4)
    victim = events("acme")[1]
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute("DELETE FROM governance_auditevent WHERE id = %s", [victim.pk])
    problems = audit.verify("acme")
    assert problems and problems[0].seq == victim.seq + 1
    assert "gap" in problems[0].reason


def test_events_are_append_only(org: Org) -> None:
    put(org, 1)
    event = events("acme")[0]
    with pytest.raises(PermissionError):
        event.save()
    with pytest.raises(PermissionError):
        event.delete()
    with pytest.raises(PermissionError):
        AuditEvent.objects.filter(pk=event.pk).update(status=1)
    with pytest.raises(PermissionError):
        AuditEvent.objects.filter(pk=event.pk).delete()
    if connection.vendor == "postgresql":
        for sql in ("UPDATE governance_auditevent SET status = 1 WHERE id = %s",
                    "DELETE FROM governance_auditevent WHERE id = %s"):
            with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), \
                    connection.cursor() as cursor:
                cursor.execute(sql, [event.pk])


def test_retention_purge_keeps_the_rest_verifiable(org: Org) -> None:
    put(org, 5)
    older = len(events("acme"))  # the org's own admin events, then the five calls
    cutoff = timezone.now() + timedelta(seconds=1)
    time.sleep(1.1)
    put(org, 3)
    assert audit.purge(cutoff) == older
    assert [e.seq for e in events("acme")] == [older + 1, older + 2, older + 3]
    assert AuditChain.objects.get(chain="acme").anchor_seq == older
    assert audit.verify("acme") == []


def test_concurrent_writers_never_fork_a_chain(org: Org) -> None:
    threads = [threading.Thread(target=lambda: audit.write_events([
        {"chain": "acme", "at": timezone.now(), "tenant_id": org.tenant.pk, "actor": "t",
         "role": "", "key_prefix": "", "action": "x", "target": "", "model": "",
         "protocol": "rest", "status": 200, "latency_ms": 0.0, "prompt_tokens": 0,
         "completion_tokens": 0, "request_id": "", "trace_id": "", "request_excerpt": "",
         "response_excerpt": "", "detail": {}} for _ in range(20)])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    rows = events("acme")
    assert [e.seq for e in rows] == list(range(1, len(rows) + 1))  # no gap, no fork
    assert sum(e.action == "x" for e in rows) == 80
    assert audit.verify("acme") == []


def test_values_the_writer_passes_as_is_are_what_django_would_write(org: Org) -> None:
    """The writer skips Django's preparation for a value of exactly its field's plain
    type (`audit._UNCHANGED`): that holds only while Django gives such a value back
    unchanged on this backend. Other values still go through Django: an int latency
    is stored as the float the hash was computed over, and the chain verifies."""
    samples: dict[type, Any] = {str: "naïve text", float: 2.5}
    checked = 0
    for field in AuditEvent._meta.concrete_fields:
        kind = audit._UNCHANGED.get(field.get_internal_type())
        if kind is not None:
            prepared = field.get_db_prep_save(samples[kind], connection)
            assert type(prepared) is kind and prepared == samples[kind], field.name
            checked += 1
    assert checked >= 15  # the text fields of an event, and its latency
    put(org, 3)  # latency_ms given as ints 0, 1, 2
    rows = [r for r in events("acme") if r.action == "chat.completions"]
    assert [r.latency_ms for r in rows] == [0.0, 1.0, 2.0]
    assert all(type(r.latency_ms) is float for r in rows)
    assert audit.verify("acme") == []


def test_auditor_reads_only_their_tenant_with_filters(org: Org) -> None:
    other = make_org("other", [Role.TENANT_ADMIN])
    put(org, 3)
    put(other, 2)
    auditor = org.client(Role.AUDITOR)
    got = auditor.get("/api/v1/audit/events?action=chat.completions&limit=2")
    assert got.status == 200 and got.body["count"] == 3 and len(got.body["items"]) == 2
    assert {e["tenant_id"] for e in got.body["items"]} == {org.tenant.pk}
    crossed = auditor.get(f"/api/v1/audit/events?tenant_id={other.tenant.pk}")
    assert {e["tenant_id"] for e in crossed.body["items"]} <= {org.tenant.pk}
    assert org.client(Role.DEVELOPER).get("/api/v1/audit/events").status == 403
    status = auditor.get("/api/v1/audit/events?status=500")
    assert status.body["count"] == 0


# -- exports with a real Celery worker --------------------------------------------------
def test_export_runs_on_a_real_celery_worker(org: Org, celery_worker: None) -> None:
    put(org, 7, response_text="reply to jane@example.com")
    auditor = org.client(Role.AUDITOR)
    made = auditor.post("/api/v1/audit/exports", {"format": "jsonl",
                                                 "action": "chat.completions"})
    assert made.status == 202 and made.body["status"] == "queued"
    export_id = made.body["id"]
    early = auditor.get(f"/api/v1/audit/exports/{export_id}/download")
    assert early.status in (200, 409)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = auditor.get(f"/api/v1/audit/exports/{export_id}").body
        if job["status"] in ("done", "failed"):
            break
        time.sleep(0.2)
    assert job["status"] == "done", job
    assert job["total"] == job["done"] == 7
    response = auditor.client.get(f"/api/v1/audit/exports/{export_id}/download",
                                  HTTP_AUTHORIZATION=f"Bearer {org.keys[Role.AUDITOR]}")
    assert response.status_code == 200
    lines = b"".join(response.streaming_content).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 7 and all(r["response_excerpt"] == "reply to [EMAIL]" for r in rows)
    assert AuditExport.objects.get(pk=export_id).path.endswith(f"audit-{export_id}.jsonl")
    other = make_org("nosy", [Role.AUDITOR])
    assert other.client(Role.AUDITOR).get(f"/api/v1/audit/exports/{export_id}").status == 404


# -- API calls ----------------------------------------------------------------------------
def test_an_export_download_is_streamed_by_the_asgi_server(
        live: Live, org: Org, tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """Served by uvicorn (ASGI), a finished export goes out a chunk at a time, whole and
    unchanged. Django's FileResponse reads the whole file into memory first there (and
    warns), for every download of a possibly huge file."""
    body = b"".join(b'{"seq": %d, "pad": "%s"}\n' % (i, b"x" * 200) for i in range(20_000))
    path = tmp_path / "audit-big.jsonl"
    path.write_bytes(body)
    export = AuditExport.objects.create(tenant=org.tenant, requested_by="test",
                                        format="jsonl", status="done", path=str(path))
    url = live.base_url.removesuffix("/v1") + f"/api/v1/audit/exports/{export.pk}/download"
    with httpx.stream("GET", url, timeout=30,
                      headers={"Authorization": f"Bearer {org.keys[Role.AUDITOR]}"}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-length"] == str(len(body))
        assert "audit-" in reply.headers["content-disposition"]
        received = b"".join(reply.iter_raw())
    assert received == body
    assert not [w for w in recwarn if "consume synchronous iterators" in str(w.message)]


def test_api_calls_are_audited_with_redacted_excerpts(live: Live, org: Org) -> None:
    admin = org.client(Role.TENANT_ADMIN)
    unsafe = admin.post("/api/v1/governance/redaction-patterns",
                        {"label": "EMP", "pattern": "(a+)+$"})
    assert unsafe.status == 422 and unsafe.body["error"]["param"] == "pattern"
    assert admin.post("/api/v1/governance/redaction-patterns",
                      {"label": "EMP", "pattern": r"EMP-\d{6}"}).status == 201
    policy_cache.clear()
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0)
    client.chat.completions.create(model="echo", messages=[
        {"role": "user", "content": "my card is 4111 1111 1111 1111 (EMP-123456)"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[
            {"role": "user", "content": "hi"}])
    rows = events("acme")
    call = next(e for e in rows if e.action == "chat.completions" and e.status == 200)
    assert call.request_excerpt == "my card is [CARD] ([EMP])"
    assert call.response_excerpt == "my card is [CARD] ([EMP])"
    assert call.protocol == "rest" and call.model == "echo" and call.prompt_tokens > 0
    assert call.key_prefix == org.key_rows[Role.DEVELOPER].prefix
    refused = next(e for e in rows if e.status == 404)
    assert refused.model == "nope" and refused.detail["code"] == "model_not_found"
    assert audit.verify("acme") == []
