"""Personal data at rest: what Sluice keeps beyond a call is redacted unless the tenant
turned that off (audited), kept no longer than the tenant's retention, in files only
the service's user can read, and Redis holds reply text no longer than the resume
window (docs/AUDIT.md, "Data protection")."""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from governance import audit, exports
from governance import privacy as stored
from governance.models import AuditEvent, AuditExport
from governance.tasks import conversations_retention
from inference import queue as q
from inference.jobs import encode_event
from sluice.errors import NotFound
from sluice.redis import sync_client
from sluice.root.cli import private_state
from streaming.batches import files
from streaming.batches.services import batch_list
from streaming.models import Batch, BatchStatus, StoredFile
from streaming.tasks import files_retention
from tenants.conversations import conversation_append, conversation_create, conversation_get
from tenants.conversations import conversation_history as history
from tenants.models import Conversation, ConversationMessage, Tenant
from tenants.privacy import tenant_privacy_update
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error, eventually, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = pytest.mark.cluster

SSN, IBAN, CARD = "219-09-9999", "DE89 3704 0044 0532 0130 00", "4111 1111 1111 1111"
# The same values as they may be stored without separators.
NEEDLES = [SSN, IBAN, CARD, "219099999", "DE89370400440532013000", "4111111111111111"]
PROMPT = f"my ssn is {SSN}, my iban {IBAN} and my card {CARD}"


def _raw(text: str) -> list[str]:
    return [n for n in NEEDLES if n in text]


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


def _jsonl(lines: list[dict[str, Any]]) -> io.BytesIO:
    data = io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())
    data.name = "requests.jsonl"
    return data


def _database_hits() -> list[str]:
    """Raw values in any row of any table (and in pg_dump's dump on PostgreSQL)."""
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")  # noqa: S608
            text = "\n".join(json.dumps(row, default=str) for row in cursor.fetchall())
            found += [f"{table}: {n}" for n in _raw(text)]
    if connection.vendor == "postgresql" and shutil.which("pg_dump"):
        db = connection.settings_dict
        dump = subprocess.run(
            ["pg_dump", "--data-only", "-h", db["HOST"] or "127.0.0.1",
             "-p", str(db["PORT"] or 5432), "-U", db["USER"] or "postgres", db["NAME"]],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PGPASSWORD": db.get("PASSWORD") or ""}).stdout
        assert "COPY public.tenants_conversationmessage" in dump
        found += [f"pg_dump: {n}" for n in _raw(dump)]
    return found


def _stream_text(entries: list[Any]) -> str:
    """A stream's entries, and the reply text its events carry joined per request (a
    reply arrives a token or a few per event: no one entry need hold a whole value)."""
    texts: dict[str, str] = {}
    for _id, fields in entries:
        for value in fields.values():
            try:
                data = json.loads(value)
            except ValueError:
                continue
            pairs = data if isinstance(data, list) else [["", data]]  # gateway: [[rid, e]..]
            for rid, event in pairs:
                if isinstance(event, dict) and isinstance(event.get("text"), str):
                    texts[rid] = texts.get(rid, "") + event["text"]
    return repr(entries) + "\n" + "\n".join(texts.values())


def _redis_values(rds: redis.Redis, key: bytes) -> str:
    kind = rds.type(key).decode()
    if kind == "stream":
        return _stream_text(rds.xrange(key))
    value: Any = {
        "string": lambda: rds.get(key),
        "hash": lambda: rds.hgetall(key),
        "list": lambda: rds.lrange(key, 0, -1),
        "set": lambda: rds.smembers(key),
        "zset": lambda: rds.zrange(key, 0, -1),
    }.get(kind, lambda: b"")()
    return repr(value)


def _redis_hits(rds: redis.Redis) -> dict[str, int]:
    """Every key of the test Redis database whose value holds a raw value -> its TTL."""
    return {key.decode(): rds.ttl(key) for key in rds.scan_iter(count=1000)
            if _raw(_redis_values(rds, key))}


@pytest.fixture
def rds() -> Iterator[redis.Redis]:
    client = sync_client(django_settings.REDIS_URL)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _fresh_policies() -> Iterator[None]:
    stored.clear()
    yield
    stored.clear()


def test_no_raw_personal_data_at_rest_after_a_call_a_conversation_a_batch_and_an_export(
        live: Live, celery_worker: None, settings: Any, tmp_path: Path,
        rds: redis.Redis) -> None:
    settings.STATE_DIR = tmp_path  # the Celery worker's state dir too
    org = make_org("atrest", [Role.DEVELOPER, Role.AUDITOR])
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0)
    conversation = org.client(Role.DEVELOPER).post("/api/v1/conversations",
                                                   {"title": "t"}).body["id"]

    # given: a call with a conversation, a streamed call, a batch, an audit export
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": PROMPT}],
        extra_body={"conversation_id": conversation})
    assert reply.choices[0].message.content == PROMPT  # the caller gets what it asked
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="echo", stream=True, messages=[{"role": "user", "content": PROMPT}]))
    assert streamed == PROMPT
    uploaded = client.files.create(purpose="batch", file=_jsonl([
        {"custom_id": f"id {SSN}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "echo", "messages": [{"role": "user", "content": PROMPT}]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": f"no model {CARD}", "messages": [{"role": "user", "content": "x"}]}},
    ]))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"note": PROMPT})
    assert batch.metadata == {"note": "my ssn is [SSN], my iban [IBAN] and my card [CARD]"}
    eventually(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"),
               90, what="the batch")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id
    output = client.files.content(done.output_file_id).text
    assert "[SSN]" in output and "id [SSN]" in output and not _raw(output)
    assert "[CARD]" in client.files.content(done.error_file_id).text
    audit.drain()
    auditor = org.client(Role.AUDITOR)
    export = auditor.post("/api/v1/audit/exports", {"format": "csv"}).body["id"]
    eventually(lambda: auditor.get(f"/api/v1/audit/exports/{export}").body["status"] == "done",
               60, what="the export")
    exported = AuditExport.objects.get(pk=export).path
    assert "[SSN]" in Path(exported).read_text()

    # then: no raw value in the database (every row of every table; pg_dump)
    assert Conversation.objects.get(public_id=conversation).messages.count() == 2
    assert _database_hits() == []
    # ...in Redis, only the calls' own event streams, for their resume window; the
    # gateways' result streams keep nothing they routed (not even the last event)
    eventually(lambda: not sum(rds.xlen(k) for k in rds.scan_iter(match="sluice:gw:*")), 10,
               what="the gateway's result stream to drop every event it routed")
    for key in rds.scan_iter(match="sluice:gw:*"):
        assert 0 < rds.ttl(key) <= q.OUT_TTL_S
    hits = _redis_hits(rds)
    assert hits and all(":out:" in key for key in hits), hits
    assert all(0 < ttl <= q.OUT_TTL_S == 600 for ttl in hits.values()), hits
    # ...and in the files: output, error and export redacted; only the uploaded input
    # file is kept as the tenant sent it; everything owner-only
    raw_files, wide = [], []
    for path in [tmp_path / "files", tmp_path / "exports", *(tmp_path / "files").rglob("*"),
                 *(tmp_path / "exports").rglob("*")]:
        if _mode(path) != (0o700 if path.is_dir() else 0o600):
            wide.append(f"{path}: {oct(_mode(path))}")
        if path.is_file() and _raw(path.read_text(errors="replace")):
            raw_files.append(str(path))
    assert wide == []
    assert raw_files == [StoredFile.objects.get(public_id=uploaded.id).path]


def test_a_tenant_admin_may_turn_redaction_off_audited_and_conversations_then_keep_raw_text(
        live: Live, bob: Org, ops: Org) -> None:
    org = make_org("owner", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
    path = f"/api/v1/tenants/{org.tenant.pk}/privacy"
    seen = org.client(Role.DEVELOPER).get(path)
    assert seen.status == 200 and seen.body["effective_redact_stored"] is True
    assert seen.body["redact_stored"] is None  # the platform default
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0)

    def converse() -> list[str]:
        conversation = org.client(Role.DEVELOPER).post("/api/v1/conversations", {}).body["id"]
        client.chat.completions.create(model="echo", messages=[
            {"role": "user", "content": PROMPT}], extra_body={"conversation_id": conversation})
        return [m.content for m in Conversation.objects.get(public_id=conversation)
                .messages.order_by("id")]

    # given: redaction on by default
    assert converse() == ["my ssn is [SSN], my iban [IBAN] and my card [CARD]"] * 2
    # when: those who may not try to turn it off
    assert_openai_error(org.client(Role.DEVELOPER).patch(path, {"redact_stored": False}), 403)
    assert_openai_error(org.client(Role.AUDITOR).patch(path, {"redact_stored": False}), 403)
    other = bob.client(Role.TENANT_ADMIN).patch(path, {"redact_stored": False})
    missing = bob.client(Role.TENANT_ADMIN).patch("/api/v1/tenants/999999/privacy",
                                                  {"redact_stored": False})
    assert_openai_error(other, 404)
    assert other.body == missing.body  # another tenant's is a missing one
    assert_openai_error(org.client(Role.TENANT_ADMIN).patch(path, {"retention_days": 0}), 422)
    # then: nothing changed
    assert Tenant.objects.get(pk=org.tenant.pk).redact_stored is None

    # when: the tenant admin turns it off
    off = org.client(Role.TENANT_ADMIN).patch(path, {"redact_stored": False})
    assert off.status == 200, off.body
    assert off.body["redact_stored"] is False and off.body["effective_redact_stored"] is False
    assert off.body["retention_days"] is None  # left as it was
    stored.clear()  # this process's cache (others see the change within a second)
    # then: a conversation keeps the raw text, and the change is audited
    assert converse() == [PROMPT, PROMPT]
    audit.drain()
    event = AuditEvent.objects.get(tenant_id=org.tenant.pk, action="tenant.privacy")
    assert event.actor == org.members[Role.TENANT_ADMIN].subject
    assert event.detail["was_redact_stored"] is None and event.detail["redact_stored"] is False
    assert event.detail["effective_redact_stored"] is False

    # when: a platform admin returns it to the platform default (on)
    back = ops.client(Role.PLATFORM_ADMIN).patch(path, {"redact_stored": None})
    assert back.status == 200 and back.body["effective_redact_stored"] is True
    stored.clear()
    assert converse() == ["my ssn is [SSN], my iban [IBAN] and my card [CARD]"] * 2
    audit.drain()
    assert AuditEvent.objects.filter(action="tenant.privacy", target=f"tenant:{org.tenant.slug}",
                                     actor=ops.members[Role.PLATFORM_ADMIN].subject).exists()


def test_batch_metadata_and_file_names_are_stored_as_given_only_when_redaction_is_off(
        alice: Org, settings: Any, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    developer = principal_for(alice.members[Role.DEVELOPER])
    from streaming.batches.services import batch_create

    def create() -> tuple[str, Any]:
        row = files.file_create(actor=developer, filename=f"{SSN}.jsonl", purpose="batch",
                                content=b"{}")
        batch = batch_create(actor=developer, input_file_id=row.public_id,
                             endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={SSN: PROMPT})
        return StoredFile.objects.get(pk=row.pk).filename, Batch.objects.get(pk=batch.pk).metadata

    assert create() == ("[SSN].jsonl",
                        {"[SSN]": "my ssn is [SSN], my iban [IBAN] and my card [CARD]"})
    tenant_privacy_update(actor=principal_for(alice.members[Role.TENANT_ADMIN]),
                          tenant_id=alice.tenant.pk, redact_stored=False)
    assert create() == (f"{SSN}.jsonl", {SSN: PROMPT})


def test_the_retention_task_deletes_conversations_and_batch_files_past_the_tenants_retention(
        alice: Org, bob: Org, settings: Any, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    settings.SLUICE_RETENTION_DAYS = 30  # bob's: the platform default
    tenant_privacy_update(actor=principal_for(alice.members[Role.TENANT_ADMIN]),
                          tenant_id=alice.tenant.pk, retention_days=7)
    ann = principal_for(alice.members[Role.DEVELOPER])
    ben = principal_for(bob.members[Role.DEVELOPER])
    eight_days_ago = timezone.now() - timedelta(days=8)

    def conversation(actor: Any, *, old: int, new: int, touched: Any) -> str:
        public_id = conversation_create(actor=actor).public_id
        conversation_append(actor=actor, public_id=public_id, messages=[
            {"role": "user", "content": f"m{i}"} for i in range(old + new)])
        rows = ConversationMessage.objects.filter(conversation__public_id=public_id)
        rows.filter(pk__in=list(rows.order_by("id").values_list("pk", flat=True)[:old])
                    ).update(created_at=eight_days_ago)
        Conversation.objects.filter(public_id=public_id).update(updated_at=touched)
        return public_id

    def stored_file(tenant: Tenant, *, at: Any) -> StoredFile:
        row = files.store(tenant_id=tenant.pk, filename="f.jsonl", purpose="batch",
                          content=b"{}", created_by="t")
        StoredFile.objects.filter(pk=row.pk).update(created_at=at)
        return row

    def batch(tenant: Tenant, source: StoredFile, status: str,
              output: StoredFile | None = None) -> Batch:
        return Batch.objects.create(tenant=tenant, public_id=f"batch_{source.public_id}",
                                    endpoint="/v1/chat/completions", input_file=source,
                                    output_file=output, status=status,
                                    principal={"subject": ann.subject},
                                    expires_at=timezone.now())

    # given: alice keeps 7 days, bob 30; data 8 days old and new in each
    stale = conversation(ann, old=2, new=0, touched=eight_days_ago)
    active = conversation(ann, old=2, new=1, touched=timezone.now())
    bobs = conversation(ben, old=2, new=0, touched=eight_days_ago)
    old_input = stored_file(alice.tenant, at=eight_days_ago)
    finished = batch(alice.tenant, old_input, BatchStatus.COMPLETED,
                     output=stored_file(alice.tenant, at=timezone.now()))
    running_input = stored_file(alice.tenant, at=eight_days_ago)
    running = batch(alice.tenant, running_input, BatchStatus.IN_PROGRESS)
    recent = stored_file(alice.tenant, at=timezone.now())
    bob_file = stored_file(bob.tenant, at=eight_days_ago)
    stray = files.files_dir(alice.tenant.pk) / "batch_gone.out.part"
    stray.write_text(PROMPT)
    assert finished.output_file is not None
    output_path = Path(finished.output_file.path)

    # then: readers see what is past retention as gone before the task runs
    with pytest.raises(NotFound):
        files.file_get(actor=ann, file_id=old_input.public_id)
    with pytest.raises(NotFound):
        conversation_get(actor=ann, public_id=stale)
    assert set(batch_list(actor=ann).values_list("pk", flat=True)) == {running.pk}
    assert [m["content"] for m in history(actor=ann, public_id=active)] == ["m2"]

    # when: the beat tasks run (twice: idempotent)
    assert conversations_retention() == {"messages": 4, "conversations": 1}
    assert files_retention() == {"batches": 1, "files": 2, "stray": 1, "responses": 0}
    assert conversations_retention() == {"messages": 0, "conversations": 0}
    assert files_retention() == {"batches": 0, "files": 0, "stray": 0, "responses": 0}

    # then: alice's old data is gone, rows and bytes; a running batch keeps its input
    assert not Conversation.objects.filter(public_id=stale).exists()
    assert list(ConversationMessage.objects.filter(conversation__public_id=active)
                .values_list("content", flat=True)) == ["m2"]
    assert not Batch.objects.filter(pk=finished.pk).exists()
    assert not Path(old_input.path).exists() and not output_path.exists()
    assert not stray.exists()
    assert set(StoredFile.objects.filter(tenant=alice.tenant).values_list("pk", flat=True)) \
        == {running_input.pk, recent.pk}
    assert Batch.objects.filter(pk=running.pk).exists() and Path(running_input.path).exists()
    # ...and bob's, 8 days old, within his 30
    assert ConversationMessage.objects.filter(conversation__public_id=bobs).count() == 2
    assert StoredFile.objects.filter(pk=bob_file.pk).exists() and Path(bob_file.path).exists()


def test_files_and_exports_are_owner_only_whatever_the_umask(alice: Org, settings: Any,
                                                              tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    (tmp_path / "files").mkdir(mode=0o755)  # as an older version left it
    (tmp_path / "files").chmod(0o755)
    developer = principal_for(alice.members[Role.DEVELOPER])
    old = os.umask(0)
    try:
        row = files.file_create(actor=developer, filename="in.jsonl", purpose="batch",
                                content=b"{}")
        export = AuditExport.objects.create(tenant=alice.tenant, requested_by="t",
                                            format="csv")
        exported = Path(exports.run(export.pk))
    finally:
        os.umask(old)
    assert [oct(_mode(p)) for p in (row.path, exported)] == ["0o600"] * 2
    assert [oct(_mode(p)) for p in (tmp_path / "files", Path(row.path).parent,
                                    exported.parent)] == ["0o700"] * 3


def test_the_run_command_makes_its_sqlite_database_and_state_dir_owner_only(
        tmp_path: Path) -> None:
    state = tmp_path / "var"
    database = state / "sluice.sqlite3"
    old = os.umask(0o022)
    try:
        private_state(state, {"ENGINE": "django.db.backends.sqlite3", "NAME": str(database)})
        with sqlite3.connect(database) as db:  # an empty file is an empty database
            db.execute("CREATE TABLE t (x)")
        database.chmod(0o644)  # as an older version left it
        private_state(state, {"ENGINE": "django.db.backends.sqlite3", "NAME": str(database)})
    finally:
        os.umask(old)
    assert (oct(_mode(state)), oct(_mode(database))) == ("0o700", "0o600")


def test_a_gone_gateways_result_stream_expires_within_the_resume_window(
        rds: redis.Redis) -> None:
    """Workers keep writing the final events of a gateway that died: its stream must
    expire like the requests' own, not keep reply text forever."""
    key = q.gateway_key("gone")
    rds.delete(key)
    event = encode_event({"t": "delta", "seq": 0, "text": PROMPT, "ids": []})
    q.add_gateway_message(rds, "gone", [q.gateway_item("rid", event)])
    assert 0 < rds.ttl(key) <= q.OUT_TTL_S == 600
    rds.delete(key)
