"""Stored replies are read again only by whoever may read the original: resumed streams
(Last-Event-ID, conversation_id + last_offset) and idempotent retries, against a live
gateway (issue #28's high finding and its idempotency finding)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from governance import audit
from governance.models import AuditEvent
from sluice.redis import sync_client
from tenants.models import Member
from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import PASSWORD, Org, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
TEXT = "the quarterly numbers are in the vault "


@dataclass
class Keys:
    org: Org
    developer: str  # started the stream
    same_member: str  # another key of the same developer
    narrowed: str  # the same developer's key that may call only "echo"
    colleague: str  # another developer of the tenant
    auditor: str
    admin: str  # tenant admin


def _key(member: Member, **kw: Any) -> str:
    return apikey_create(actor=principal_for(member), name="extra", **kw).secret


@pytest.fixture
def keys(live: Live) -> Keys:
    org = make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
    user = get_user_model().objects.create_user(username="alice-dev2", password=PASSWORD)
    colleague = Member.objects.create(tenant=org.tenant, user=user, role=Role.DEVELOPER)
    developer = org.members[Role.DEVELOPER]
    return Keys(org, org.keys[Role.DEVELOPER], _key(developer),
                _key(developer, allowed_models=["echo"]), _key(colleague),
                org.keys[Role.AUDITOR], org.keys[Role.TENANT_ADMIN])


@pytest.fixture
def http(live: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client


def _auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def _text(body: str) -> str:
    out = ""
    for line in body.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                out += chunk["choices"][0]["delta"].get("content") or ""
    return out


def _stream(http: httpx.Client, key: str, **extra: Any) -> tuple[str, str]:
    """A whole stream of the slow echo model: (its request id, its text)."""
    body = {"model": "slow-echo", "stream": True,
            "messages": [{"role": "user", "content": TEXT}], **extra}
    response = http.post("/chat/completions", json=body, headers=_auth(key))
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"], _text(response.text)


def _resume(http: httpx.Client, key: str, rid: str, model: str = "slow-echo"
            ) -> httpx.Response:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    return http.post("/chat/completions", json=body,
                     headers=_auth(key, **{"Last-Event-ID": f"{rid}:start"}))


def test_a_stream_is_resumed_only_by_its_own_caller(http: httpx.Client, keys: Keys) -> None:
    """Given a developer's finished stream, when others of the tenant replay it by its
    request id, then only the same member (any of its keys that may use the model) gets
    it; everyone else gets exactly the unknown-id answer, and no text."""
    rid, text = _stream(http, keys.developer)
    assert text == TEXT
    unknown = _resume(http, keys.developer, "0" * 24)
    assert unknown.status_code == 404

    for who in (keys.colleague, keys.narrowed):
        denied = _resume(http, who, rid)
        assert denied.status_code == 404, denied.text
        assert denied.json() == unknown.json()
    auditor = _resume(http, keys.auditor, rid)
    assert auditor.status_code == 403 and TEXT not in auditor.text
    other_model = _resume(http, keys.developer, rid, model="echo")
    assert other_model.status_code == 404 and TEXT not in other_model.text

    for own in (keys.developer, keys.same_member):
        replayed = _resume(http, own, rid)
        assert replayed.status_code == 200, replayed.text
        assert _text(replayed.text) == TEXT


def test_resumes_are_audited(http: httpx.Client, keys: Keys) -> None:
    rid, _ = _stream(http, keys.developer)
    assert _resume(http, keys.developer, rid).status_code == 200
    assert _resume(http, keys.colleague, rid).status_code == 404
    audit.drain()
    resumes = AuditEvent.objects.filter(tenant=keys.org.tenant,
                                        action="chat.completions.resume")
    assert sorted(e.status for e in resumes) == [200, 404]
    assert all(e.request_id == rid for e in resumes if e.status == 200)


def test_a_conversation_stream_is_resumed_under_the_conversation_rules(
        http: httpx.Client, keys: Keys, live: Live) -> None:
    """Given a developer's conversation with a stream, another developer gets a 404 for
    it (as GET /api/v1/conversations/{id} does), the tenant admin (who may read every
    conversation of the tenant) and the owner get the stream."""
    conversations = live.base_url.replace("/v1", "/api/v1") + "/conversations"
    conversation = http.post(conversations, json={},
                             headers=_auth(keys.developer)).json()["id"]
    _rid, text = _stream(http, keys.developer, conversation_id=conversation)
    assert text == TEXT

    def resume(key: str) -> httpx.Response:
        body = {"model": "slow-echo", "stream": True, "conversation_id": conversation,
                "last_offset": -1, "messages": [{"role": "user", "content": "x"}]}
        return http.post("/chat/completions", json=body, headers=_auth(key))

    denied = resume(keys.colleague)
    assert denied.status_code == 404 and TEXT not in denied.text
    assert http.get(f"{conversations}/{conversation}",
                    headers=_auth(keys.colleague)).status_code == 404
    for allowed in (keys.developer, keys.admin):
        replayed = resume(allowed)
        assert replayed.status_code == 200, replayed.text
        assert _text(replayed.text) == TEXT


def test_bad_last_event_ids_are_a_400_naming_the_header(http: httpx.Client,
                                                        keys: Keys) -> None:
    body = {"model": "slow-echo", "stream": True, "messages": [{"role": "user",
                                                                "content": "x"}]}
    for value in ("abc:²", "abc:" + "9" * 4300, "nope:3", "ab:1x", "é:1"):
        response = http.post("/chat/completions", json=body, headers={
            "Authorization": f"Bearer {keys.developer}", "Last-Event-ID": value.encode()})
        assert response.status_code == 400, (value[:20], response.text)
        assert response.json()["error"]["param"] == "Last-Event-ID"


def _call(http: httpx.Client, key: str, idem: str, content: str) -> httpx.Response:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}]}
    return http.post("/chat/completions", json=body,
                     headers=_auth(key, **{"Idempotency-Key": idem}))


def test_idempotency_keys_are_per_caller_and_bound_to_the_request(
        http: httpx.Client, keys: Keys, live: Live) -> None:
    """Given a developer's call with an Idempotency-Key, when another developer sends the
    same key with the same body, then it is a call of its own (not the first's reply);
    the same caller retrying gets the first reply; the same key with another body is a
    422; and Redis holds no trace of the key's text."""
    idem = "order 536-42-7151 jane@example.com"
    first = _call(http, keys.developer, idem, "mine")
    assert first.status_code == 200, first.text
    again = _call(http, keys.developer, idem, "mine")
    assert again.json()["id"] == first.json()["id"]
    other = _call(http, keys.colleague, idem, "mine")
    assert other.status_code == 200
    assert other.json()["id"] != first.json()["id"]
    changed = _call(http, keys.developer, idem, "something else")
    assert changed.status_code == 422, changed.text
    error = changed.json()["error"]
    assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
    assert "mine" not in changed.text

    store = sync_client(settings.REDIS_URL)
    names = [k.decode() for k in store.scan_iter(match="*idem*", count=1000)]
    assert names, "the idempotency records exist"
    assert all(re.fullmatch(r"sluice:\{alice\}:idem:[0-9a-f]{64}", n) for n in names), names


def test_bad_idempotency_keys_are_a_400(http: httpx.Client, keys: Keys) -> None:
    for idem in ("x" * 256, "tab\there"):
        response = _call(http, keys.developer, idem, "x")
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "Idempotency-Key"
