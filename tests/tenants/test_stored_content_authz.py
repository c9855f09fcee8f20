"""Who may read what Sluice stores (issue #28's authorization review): conversations,
files, batches and their output, audit events and exports, usage, and the admin UI
pages that show them. Each rule is checked three ways where it applies: another
tenant's object (404, word for word the answer for a missing id, nothing changed),
another member's object where the rule is own-only (the same 404), and a role that may
not read the kind at all (403 before any lookup, so no id is probed). The per-id
cross-tenant answers of every route are in tests/governance/test_oracles.py; resumed
streams and idempotent retries in tests/streaming/test_replay_authz.py."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from secrets import token_hex
from typing import Any

import httpx
import pytest
import websockets
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.forms.models import model_to_dict
from django.test import Client
from django.utils import timezone

from governance import audit
from governance.models import AuditEvent, AuditExport, UsageRecord
from streaming.models import Batch, BatchStatus, StoredFile
from tenants.conversations import conversation_append, conversation_create
from tenants.models import Conversation, ConversationMessage, Member
from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import (
    PASSWORD,
    ApiClient,
    Org,
    Response,
    assert_openai_error,
    make_org,
    principal_for,
    signed_in,
)
from tests.streaming import conftest as streaming_fixtures
from tests.streaming.conftest import Live

live = streaming_fixtures.live  # the live gateway, where only the inference path serves it
TA, DEV, AUD, PA = Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR, Role.PLATFORM_ADMIN
SECRET = "SECRET-7f3a"  # in every stored thing a denied reader must not see
MISSING = {"conversation": f"conv_{'0' * 24}", "file": f"file-{'0' * 24}",
           "batch": f"batch_{'0' * 24}"}
CSRF = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"')  # new on every page
BATCH_LINE = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "echo", "messages": [
                             {"role": "user", "content": f"input {SECRET}"}]}}).encode() + b"\n"


# -- helpers ------------------------------------------------------------------------------
def colleague(org: Org) -> tuple[Member, str]:
    """A second developer of `org`, and an API key of theirs."""
    user = get_user_model().objects.create_user(username=f"{org.tenant.slug}-dev2",
                                                password=PASSWORD)
    member = Member.objects.create(tenant=org.tenant, user=user, role=DEV)
    return member, apikey_create(actor=principal_for(member), name="dev2").secret


def conversation(org: Org, role: Role = DEV) -> str:
    """A conversation of `role`'s member with one stored turn holding SECRET."""
    owner = principal_for(org.members[role])
    made = conversation_create(actor=owner, title=f"title {SECRET}")
    conversation_append(actor=owner, public_id=made.public_id, messages=[
        {"role": "user", "content": f"my {SECRET}"},
        {"role": "assistant", "content": f"reply {SECRET}"}])
    return made.public_id


def upload(key: str) -> str:
    response = Client().post("/v1/files", {"purpose": "batch", "file": SimpleUploadedFile(
        "in.jsonl", BATCH_LINE)}, HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 200, response.content
    return str(response.json()["id"])


def finished_batch(key: str, state_dir: Path) -> tuple[str, str, str]:
    """(input file, batch, output file) of a batch the key's caller ran to the end: its
    output stored as the runner stores it (a file of the batch's creator)."""
    file_id = upload(key)
    made = ApiClient(key).post("/v1/batches", {"input_file_id": file_id,
                                               "endpoint": "/v1/chat/completions"})
    assert made.status == 200, made.body
    batch = Batch.objects.get(public_id=made.body["id"])
    content = json.dumps({"custom_id": "1", "response": {"status_code": 200, "body": {
        "choices": [{"message": {"content": f"reply {SECRET}"}}]}}}).encode() + b"\n"
    public_id = f"file-{token_hex(12)}"
    path = state_dir / public_id
    path.write_bytes(content)
    output = StoredFile.objects.create(
        tenant_id=batch.tenant_id, public_id=public_id, filename=f"{batch.public_id}_output.jsonl",
        purpose="batch_output", bytes=len(content), path=str(path),
        created_by=batch.principal["subject"])
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.COMPLETED, output_file=output,
                                             total=1, completed=1,
                                             completed_at=timezone.now())
    return file_id, batch.public_id, public_id


def snapshot() -> dict[str, Any]:
    rows: dict[str, Any] = {model.__name__: [model_to_dict(r) for r in model.objects.order_by("pk")]
                            for model in (Conversation, ConversationMessage, StoredFile, Batch)}
    rows["bytes"] = {f.path: Path(f.path).read_bytes() for f in StoredFile.objects.all()
                     if Path(f.path).exists()}
    return rows


def masked(response: Response, asked: str) -> str:
    """The answer with the id that was asked for replaced (an answer may echo the
    caller's own input; that tells nothing about the object)."""
    text = response.body if isinstance(response.body, str) else json.dumps(response.body)
    return text.replace(asked, "<id>")


def assert_like_missing(client: ApiClient, method: str, path: str, kind: str, theirs: str,
                        body: Callable[[str], Any] | None = None) -> None:
    """`path` (or `body`) naming `theirs` answers exactly as it does naming a missing
    id of that kind: a 404."""
    def ask(some_id: str) -> Response:
        return client.call(method, path.format(some_id), body(some_id) if body else None)

    other, absent = ask(theirs), ask(MISSING[kind])
    assert_openai_error(other, 404)
    assert_openai_error(absent, 404)
    assert masked(other, theirs) == masked(absent, MISSING[kind])
    assert SECRET not in masked(other, theirs)


def assert_role_refused(response: Response) -> None:
    error = assert_openai_error(response, 403)
    assert error["type"] == "permission_error" and SECRET not in json.dumps(response.body)



@pytest.fixture
def state_dir(settings: Any, tmp_path: Path) -> Path:
    settings.STATE_DIR = tmp_path  # uploads land in the test's own folder
    return tmp_path


# -- conversations ------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_developer_reads_only_their_own_conversations(alice: Org) -> None:
    """Given a developer's conversation with stored turns, when another developer of the
    tenant reads, lists or deletes it, then each is the missing-id answer and nothing
    changed; the owner and the tenant admin read it, messages included."""
    theirs = conversation(alice)
    _, other_key = colleague(alice)
    other = ApiClient(other_key)
    before = snapshot()
    assert_like_missing(other, "GET", "/api/v1/conversations/{}", "conversation", theirs)
    assert_like_missing(other, "DELETE", "/api/v1/conversations/{}", "conversation", theirs)
    listed = other.get("/api/v1/conversations")
    assert listed.status == 200 and listed.body["items"] == []
    assert snapshot() == before
    for reader in (alice.client(DEV), alice.client(TA)):
        got = reader.get(f"/api/v1/conversations/{theirs}")
        assert got.status == 200 and [m["content"] for m in got.body["messages"]] == [
            f"my {SECRET}", f"reply {SECRET}"]
        assert theirs in {c["id"] for c in reader.get("/api/v1/conversations").body["items"]}


@pytest.mark.django_db
def test_an_auditor_reads_no_conversation(alice: Org) -> None:
    """Given stored conversations of a developer and of the tenant admin, an auditor of
    the tenant gets a 403 for the list and for each id (the same for a missing one)."""
    auditor = alice.client(AUD)
    assert_role_refused(auditor.get("/api/v1/conversations"))
    for public_id in (conversation(alice, DEV), conversation(alice, TA),
                      MISSING["conversation"]):
        assert_role_refused(auditor.get(f"/api/v1/conversations/{public_id}"))


# -- files and batches ----------------------------------------------------------------------
@pytest.mark.django_db
def test_auditors_read_no_files_and_no_batches(alice: Org, state_dir: Path) -> None:
    """Auditors use no models: every files and batches route is a 403 for them, before
    any lookup (the same for an id that exists and one that does not)."""
    file_id, batch_id, output_id = finished_batch(alice.keys[DEV], state_dir)
    auditor = alice.client(AUD)
    before = snapshot()
    for path in ("/v1/files", "/v1/batches"):
        assert_role_refused(auditor.get(path))
    for some_file in (file_id, output_id, MISSING["file"]):
        assert_role_refused(auditor.get(f"/v1/files/{some_file}"))
        assert_role_refused(auditor.get(f"/v1/files/{some_file}/content"))
        assert_role_refused(auditor.delete(f"/v1/files/{some_file}"))
    for some_batch in (batch_id, MISSING["batch"]):
        assert_role_refused(auditor.get(f"/v1/batches/{some_batch}"))
        assert_role_refused(auditor.post(f"/v1/batches/{some_batch}/cancel"))
    assert snapshot() == before


@pytest.mark.django_db
def test_a_tenant_admin_reads_every_file_and_batch_of_the_tenant(alice: Org,
                                                                state_dir: Path) -> None:
    file_id, batch_id, output_id = finished_batch(alice.keys[DEV], state_dir)
    admin = alice.client(TA)
    assert admin.get(f"/v1/batches/{batch_id}").body["output_file_id"] == output_id
    assert SECRET in json.dumps(admin.get(f"/v1/files/{output_id}/content").body)
    assert {file_id, output_id} <= {f["id"] for f in admin.get("/v1/files").body["data"]}


@pytest.mark.django_db
def test_a_developer_reads_only_their_own_files(alice: Org, state_dir: Path) -> None:
    """Given a developer's uploaded file and batch output, when another developer of the
    tenant lists, reads, downloads or deletes them, then each id is the missing-id answer,
    the list leaves them out, and nothing changed."""
    file_id, _, output_id = finished_batch(alice.keys[DEV], state_dir)
    _, other_key = colleague(alice)
    other = ApiClient(other_key)
    before = snapshot()
    assert not {file_id, output_id} & {f["id"] for f in other.get("/v1/files").body["data"]}
    for theirs in (file_id, output_id):
        assert_like_missing(other, "GET", "/v1/files/{}", "file", theirs)
        assert_like_missing(other, "GET", "/v1/files/{}/content", "file", theirs)
        assert_like_missing(other, "DELETE", "/v1/files/{}", "file", theirs)
    assert snapshot() == before


@pytest.mark.django_db
def test_a_developer_reads_only_their_own_batches(alice: Org, state_dir: Path) -> None:
    """Given a developer's finished batch and a running one, when another developer of
    the tenant lists, reads or cancels them, or names the input file in a batch of
    their own, then each id is the missing-id answer and nothing changed."""
    file_id, done_id, _ = finished_batch(alice.keys[DEV], state_dir)
    running = alice.client(DEV).post("/v1/batches", {"input_file_id": file_id,
                                                     "endpoint": "/v1/chat/completions"})
    _, other_key = colleague(alice)
    other = ApiClient(other_key)
    before = snapshot()
    listed = {b["id"] for b in other.get("/v1/batches").body["data"]}
    assert not {done_id, running.body["id"]} & listed
    for theirs in (done_id, running.body["id"]):
        assert_like_missing(other, "GET", "/v1/batches/{}", "batch", theirs)
        assert_like_missing(other, "POST", "/v1/batches/{}/cancel", "batch", theirs)
    assert_like_missing(other, "POST", "/v1/batches", "file", file_id,
                        lambda i: {"input_file_id": i, "endpoint": "/v1/chat/completions"})
    assert snapshot() == before


# -- every list, across tenants ---------------------------------------------------------------
@pytest.mark.django_db
def test_no_list_of_stored_content_shows_another_tenants(alice: Org, bob: Org,
                                                        state_dir: Path) -> None:
    """Given bob's conversations, files, batches, audit events and usage, alice's tenant
    admin (who reads all of alice's) lists each, even naming bob's tenant id, and sees
    none of bob's, while bob's admin sees them (the lists work)."""
    bob_conversation = conversation(bob)
    bob_file, bob_batch, bob_output = finished_batch(bob.keys[DEV], state_dir)
    audit.record_call(principal=principal_for(bob.members[DEV]),
                      action="chat.completions", model="bob-only-model", protocol="rest",
                      status=200, latency_ms=1.0, request_text=f"hi {SECRET}")
    audit.drain()
    UsageRecord.objects.create(tenant=bob.tenant, model="bob-only-model",
                               key_prefix=bob.key_rows[DEV].prefix, day=timezone.now().date(),
                               requests=1)
    theirs = {bob_conversation, bob_file, bob_batch, bob_output}
    lists = ["/api/v1/conversations", "/v1/files", "/v1/batches", "/api/v1/audit/events",
             f"/api/v1/audit/events?tenant_id={bob.tenant.pk}", "/api/v1/governance/usage",
             f"/api/v1/governance/usage?tenant_id={bob.tenant.pk}"]
    for path in lists:
        mine, bobs = alice.client(TA).get(path), bob.client(TA).get(path.split("?")[0])
        assert mine.status == bobs.status == 200, (path, mine.body)
        text = json.dumps(mine.body)
        assert not any(i in text for i in theirs) and "bob-only-model" not in text, path
        assert SECRET not in text, path
        assert any(i in json.dumps(bobs.body) for i in theirs) or \
            "bob-only-model" in json.dumps(bobs.body), path
    page = signed_in(alice, AUD).get("/ui/audit").content.decode()
    assert "bob-only-model" not in page
    assert "bob-only-model" in signed_in(bob, AUD).get("/ui/audit").content.decode()


# -- audit exports ------------------------------------------------------------------------------
@pytest.mark.django_db
def test_an_every_tenant_export_is_read_by_platform_admins_only(alice: Org, ops: Org) -> None:
    """Given a platform admin's export of every tenant's events (no tenant), a tenant's
    auditor and admin get the missing-id answer for it, in the API and the UI."""
    made = ops.client(PA).post("/api/v1/audit/exports", {"format": "jsonl"})
    assert made.status == 202, made.body
    export = AuditExport.objects.get(pk=made.body["id"])
    assert export.tenant_id is None
    missing = AuditExport.objects.order_by("-pk").first().pk + 1000  # type: ignore[union-attr]
    for role in (AUD, TA):
        reader = alice.client(role)
        for suffix in ("", "/download"):
            other = reader.get(f"/api/v1/audit/exports/{export.pk}{suffix}")
            absent = reader.get(f"/api/v1/audit/exports/{missing}{suffix}")
            assert_openai_error(other, 404)
            assert other.body == absent.body
        ui = signed_in(alice, role)
        for suffix in ("", "?format=json", "/download"):
            pages = [ui.get(f"/ui/audit/exports/{i}{suffix}") for i in (export.pk, missing)]
            assert [p.status_code for p in pages] == [404, 404]
            texts = [CSRF.sub("csrf", p.content.decode()).replace(
                f"/ui/audit/exports/{i}", "<path>")
                for p, i in zip(pages, (export.pk, missing), strict=True)]
            assert texts[0] == texts[1]
    assert ops.client(PA).get(f"/api/v1/audit/exports/{export.pk}").status == 200


# -- the admin UI's pages --------------------------------------------------------------------------
@pytest.mark.django_db
def test_ui_pages_show_a_developer_only_their_own(alice: Org) -> None:
    """The conversations and usage pages list the signed-in developer's own rows only; the
    tenant admin's conversations page lists everyone's; auditors open neither the
    conversations page nor, like developers, an audit event."""
    theirs = conversation(alice)
    UsageRecord.objects.create(tenant=alice.tenant, model="dev-model",
                               key_prefix=alice.key_rows[DEV].prefix,
                               day=timezone.now().date(), requests=7)
    colleague(alice)
    other = Client()
    assert other.post("/ui/login", {"username": "alice-dev2", "password": PASSWORD}
                      ).status_code == 302
    for url, marker in (("/ui/conversations", theirs), ("/ui/usage", "dev-model")):
        assert marker not in other.get(url).content.decode(), url
        assert marker in signed_in(alice, DEV).get(url).content.decode(), url
    assert theirs in signed_in(alice, TA).get("/ui/conversations").content.decode()
    assert signed_in(alice, AUD).get("/ui/conversations").status_code == 403
    audit.record_call(principal=principal_for(alice.members[DEV]),
                      action="chat.completions", model="echo", protocol="rest", status=200,
                      latency_ms=1.0, request_text=f"hi {SECRET}")
    audit.drain()
    event = AuditEvent.objects.filter(tenant=alice.tenant).latest("id").pk
    refused = signed_in(alice, DEV).get(f"/ui/audit/{event}")
    assert refused.status_code == 403 and SECRET not in refused.content.decode()
    assert signed_in(alice, AUD).get(f"/ui/audit/{event}").status_code == 200


# -- stored content through the inference path (live gateway) -------------------------------------
def _streamed(response: httpx.Response) -> str:
    """The text of an SSE chat stream (its deltas joined)."""
    out = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or ():
                out += choice["delta"].get("content") or ""
    return out


def _socket_error(live: Live, key: str, conversation_id: str) -> dict[str, Any]:
    """The error frame a chat naming `conversation_id` gets over the WebSocket."""
    url = live.base_url.replace("http://", "ws://") + "/chat/socket"

    async def go() -> dict[str, Any]:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "c", "request": {
                "model": "echo", "conversation_id": conversation_id,
                "messages": [{"role": "user", "content": "go on"}]}}))
            while True:
                frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 20))
                if frame["type"] in ("chat.done", "error"):
                    return frame
    return asyncio.run(go())


def _chat(http: httpx.Client, key: str, **extra: Any) -> httpx.Response:
    body = {"model": "echo", "messages": [{"role": "user", "content": "go on"}], **extra}
    return http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.slow
def test_a_call_names_only_a_conversation_or_stream_its_caller_may_read(live: Live) -> None:
    """Given a developer's conversation with stored turns and a finished stream, when
    another developer of the tenant or bob's developer names that conversation in a call
    over REST or the WebSocket (its history would feed the model), or bob's developer
    resumes the stream by its request id, then each is the missing-id answer, nothing is
    appended, and no stored text comes back; an auditor is refused for the role."""
    alice = make_org("alice", [TA, DEV, AUD])
    bob = make_org("bob", [DEV])
    theirs = conversation(alice)
    _, other_key = colleague(alice)
    messages = ConversationMessage.objects.count()
    with httpx.Client(base_url=live.base_url, timeout=30) as http:
        for key in (other_key, bob.keys[DEV]):
            denied = _chat(http, key, conversation_id=theirs)
            absent = _chat(http, key, conversation_id=MISSING["conversation"])
            assert denied.status_code == absent.status_code == 404, denied.text
            assert denied.json() == absent.json() and SECRET not in denied.text
            over_socket = _socket_error(live, key, theirs)
            assert over_socket == _socket_error(live, key, MISSING["conversation"])
            assert over_socket["type"] == "error" and SECRET not in json.dumps(over_socket)
        refused = _chat(http, alice.keys[AUD], conversation_id=theirs)
        assert refused.status_code == 403 and SECRET not in refused.text
        assert ConversationMessage.objects.count() == messages
        own = _chat(http, alice.keys[DEV], conversation_id=theirs)
        assert own.status_code == 200, own.text

        stream = _chat(http, alice.keys[DEV], stream=True,
                       messages=[{"role": "user", "content": f"say {SECRET}"}])
        assert stream.status_code == 200 and SECRET in _streamed(stream)
        rid = stream.headers["x-request-id"]

        def resume(key: str, request_id: str) -> httpx.Response:
            return http.post("/chat/completions", headers={
                "Authorization": f"Bearer {key}", "Last-Event-ID": f"{request_id}:start"},
                json={"model": "echo", "stream": True,
                      "messages": [{"role": "user", "content": "x"}]})
        other_tenant, unknown = resume(bob.keys[DEV], rid), resume(bob.keys[DEV], "0" * 24)
        assert other_tenant.status_code == unknown.status_code == 404, other_tenant.text
        assert other_tenant.json() == unknown.json() and SECRET not in other_tenant.text
        assert SECRET in _streamed(resume(alice.keys[DEV], rid))
