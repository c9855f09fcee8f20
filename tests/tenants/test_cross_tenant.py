"""Every object endpoint refuses another tenant's object with 404 and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.forms.models import model_to_dict

from governance.models import Quota, RateLimitPolicy
from streaming.apis.responses.store import response_create
from streaming.models import StoredResponse
from tenants.conversations import conversation_create
from tenants.models import ApiKey, Conversation, Member, Tenant
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error, principal_for

pytestmark = pytest.mark.django_db


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row, minus last_used_at (bookkeeping of the caller's own key)."""
    return {
        "conversations": [model_to_dict(c) for c in Conversation.objects.order_by("pk")],
        "tenants": [model_to_dict(t) for t in Tenant.objects.order_by("pk")],
        "members": [model_to_dict(m) for m in Member.objects.order_by("pk")],
        "keys": [model_to_dict(k, exclude=["last_used_at"])
                 for k in ApiKey.objects.order_by("pk")],
        "limits": [model_to_dict(r) for r in RateLimitPolicy.objects.order_by("pk")],
        "quotas": [model_to_dict(q) for q in Quota.objects.order_by("pk")],
        "responses": [model_to_dict(r) for r in StoredResponse.objects.order_by("pk")],
    }


Target = Callable[[Org], str]
CASES: list[tuple[str, str, Target, Any]] = [
    ("GET", "tenant", lambda b: f"/api/v1/tenants/{b.tenant.pk}", None),
    ("PATCH", "tenant", lambda b: f"/api/v1/tenants/{b.tenant.pk}", {"name": "pwned"}),
    ("GET", "privacy", lambda b: f"/api/v1/tenants/{b.tenant.pk}/privacy", None),
    ("PATCH", "privacy", lambda b: f"/api/v1/tenants/{b.tenant.pk}/privacy",
     {"redact_stored": False, "retention_days": 1}),
    ("GET", "member", lambda b: f"/api/v1/members/{b.members[Role.TENANT_ADMIN].pk}", None),
    ("PATCH", "member", lambda b: f"/api/v1/members/{b.members[Role.DEVELOPER].pk}",
     {"role": "auditor"}),
    ("DELETE", "member", lambda b: f"/api/v1/members/{b.members[Role.DEVELOPER].pk}", None),
    ("GET", "key", lambda b: f"/api/v1/keys/{b.key_rows[Role.DEVELOPER].pk}", None),
    ("DELETE", "key", lambda b: f"/api/v1/keys/{b.key_rows[Role.DEVELOPER].pk}", None),
    ("GET", "conversation", lambda b: f"/api/v1/conversations/{_conversation(b)}", None),
    ("DELETE", "conversation", lambda b: f"/api/v1/conversations/{_conversation(b)}", None),
    ("GET", "rate limit", lambda b: f"/api/v1/governance/rate-limits/{_limit(b)}", None),
    ("PATCH", "rate limit", lambda b: f"/api/v1/governance/rate-limits/{_limit(b)}",
     {"requests_per_minute": 100_000}),
    ("DELETE", "rate limit", lambda b: f"/api/v1/governance/rate-limits/{_limit(b)}", None),
    ("GET", "quota", lambda b: f"/api/v1/governance/quotas/{_quota(b)}", None),
    ("GET", "response", lambda b: f"/v1/responses/{_response(b)}", None),
    ("GET", "response", lambda b: f"/v1/responses/{_response(b)}/input_items", None),
    ("DELETE", "response", lambda b: f"/v1/responses/{_response(b)}", None),
]


def _limit(org: Org) -> int:
    """A limit bob's admin put on bob's keys."""
    row = RateLimitPolicy.objects.filter(tenant=org.tenant).first()
    return (row or RateLimitPolicy.objects.create(scope="api_key", tenant=org.tenant,
                                                  requests_per_minute=5)).pk


def _quota(org: Org) -> int:
    row = Quota.objects.filter(tenant=org.tenant).first()
    return (row or Quota.objects.create(tenant=org.tenant, max_requests=5)).pk


def _response(org: Org) -> str:
    """Bob's admin's stored response (created once per test)."""
    existing = StoredResponse.objects.filter(tenant=org.tenant).first()
    if existing is not None:
        return existing.public_id
    body = {"id": f"resp_{'b' * 24}", "object": "response", "status": "completed",
            "model": "echo", "output": [], "usage": None}
    return response_create(actor=principal_for(org.members[Role.TENANT_ADMIN]), body=body,
                           input_items=[]).public_id


def _conversation(org: Org) -> str:
    """Bob's admin's conversation (created once per test)."""
    admin = principal_for(org.members[Role.TENANT_ADMIN])
    existing = Conversation.objects.filter(tenant=org.tenant).first()
    return (existing or conversation_create(actor=admin, title="bob's")).public_id


@pytest.mark.parametrize(("method", "kind", "target", "body"), CASES,
                         ids=[f"{m}-{k}" for m, k, _, _ in CASES])
def test_alice_admin_cannot_touch_bobs_object(
    alice: Org, bob: Org, method: str, kind: str, target: Target, body: Any
) -> None:
    path = target(bob)
    before = snapshot()
    response = alice.client(Role.TENANT_ADMIN).call(method, path, body)
    if kind == "tenant" and method == "PATCH":
        # Tenant updates are a platform-admin action: a tenant admin is denied outright.
        assert_openai_error(response, 403)
    else:
        assert_openai_error(response, 404)
    assert snapshot() == before
    # and bob's own admin still can (the 404 was about alice, not a broken route)
    if method == "GET":
        assert bob.client(Role.TENANT_ADMIN).call(method, target(bob)).status == 200


def test_lists_never_show_another_tenants_objects(alice: Org, bob: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    members = admin.get("/api/v1/members").body["items"]
    keys = admin.get("/api/v1/keys").body["items"]
    assert {m["username"].split("-")[0] for m in members} == {"alice"}
    bob_key_ids = {k.pk for k in bob.key_rows.values()}
    assert keys and not bob_key_ids & {k["id"] for k in keys}


def test_developer_sees_only_own_keys_in_own_tenant(alice: Org) -> None:
    dev = alice.client(Role.DEVELOPER)
    listed = dev.get("/api/v1/keys").body
    assert [k["id"] for k in listed["items"]] == [alice.key_rows[Role.DEVELOPER].pk]
    admins_key = alice.key_rows[Role.TENANT_ADMIN].pk
    before = snapshot()
    assert_openai_error(dev.get(f"/api/v1/keys/{admins_key}"), 404)
    assert_openai_error(dev.delete(f"/api/v1/keys/{admins_key}"), 404)
    assert snapshot() == before


def test_platform_admin_reads_any_tenant(alice: Org, ops: Org) -> None:
    response = ops.client(Role.PLATFORM_ADMIN).get(f"/api/v1/tenants/{alice.tenant.pk}")
    assert response.status == 200 and response.body["slug"] == "alice"
