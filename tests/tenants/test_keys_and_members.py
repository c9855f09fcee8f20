"""API key life cycle and member management, including mass-assignment attempts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import apikeys
from tenants.models import ApiKey, Member, Tenant
from tenants.roles import Role
from tests.conftest import PASSWORD, ApiClient, Org, assert_openai_error

pytestmark = pytest.mark.django_db


def test_key_secret_is_shown_once_and_stored_only_as_hash(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    created = admin.post("/api/v1/keys", {"name": "prod"})
    assert created.status == 201
    secret = created.body["key"]
    assert apikeys.parse(secret) is not None
    row = ApiKey.objects.get(pk=created.body["id"])
    assert secret not in (row.key_hash, row.prefix) and row.key_hash == apikeys.hash_key(secret)
    fetched = admin.get(f"/api/v1/keys/{row.pk}").body
    listed = admin.get("/api/v1/keys").body
    assert "key" not in fetched and secret not in str(listed)
    assert fetched["display"].startswith(f"sk-sluice-{row.prefix}-")
    assert ApiClient(secret).get("/api/v1/me").status == 200


def test_revoked_and_expired_keys_are_refused(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    created = admin.post("/api/v1/keys", {"name": "short"}).body
    assert admin.delete(f"/api/v1/keys/{created['id']}").body["revoked_at"]
    error = assert_openai_error(ApiClient(created["key"]).get("/api/v1/me"), 401)
    assert error["code"] == "revoked_api_key"
    later = admin.post("/api/v1/keys", {"name": "soon", "expires_at":
                                        (timezone.now() + timedelta(hours=1)).isoformat()}).body
    ApiKey.objects.filter(pk=later["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert assert_openai_error(ApiClient(later["key"]).get("/api/v1/me"), 401)["code"] == \
        "expired_api_key"


def test_wrong_secret_with_valid_prefix_is_refused(alice: Org) -> None:
    real = alice.keys[Role.DEVELOPER]
    forged = real[:-4] + ("AAAA" if not real.endswith("AAAA") else "BBBB")
    assert_openai_error(ApiClient(forged).get("/api/v1/me"), 401)


def test_key_cannot_be_created_above_own_role_or_scope(alice: Org) -> None:
    dev = alice.client(Role.DEVELOPER)
    before = ApiKey.objects.count()
    assert_openai_error(dev.post("/api/v1/keys", {"name": "x", "role": "tenant_admin"}), 403)
    assert_openai_error(dev.post("/api/v1/keys", {"name": "x", "role": "auditor"}), 403)
    assert_openai_error(alice.client(Role.TENANT_ADMIN).post(
        "/api/v1/keys", {"name": "x", "role": "platform_admin"}), 403)
    narrow = dev.post("/api/v1/keys", {"name": "narrow", "allowed_models": ["tiny"]}).body
    child = ApiClient(narrow["key"])
    assert_openai_error(child.post("/api/v1/keys", {"name": "wide",
                                                    "allowed_models": ["tiny", "big"]}), 403)
    inherited = child.post("/api/v1/keys", {"name": "inherit"}).body
    assert inherited["allowed_models"] == ["tiny"], "a child key must not widen to all models"
    assert ApiKey.objects.count() == before + 2


def test_mass_assignment_fields_are_rejected(alice: Org, bob: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    before = (ApiKey.objects.count(), Member.objects.count())
    for body in ({"name": "x", "tenant_id": bob.tenant.pk}, {"name": "x", "key_hash": "0" * 64},
                 {"name": "x", "created_by": "member:1"}, {"name": "x", "revoked_at": None}):
        error = assert_openai_error(admin.post("/api/v1/keys", body), 422)
        assert error["code"] == "unknown_field"
    error = assert_openai_error(admin.post("/api/v1/members", {
        "username": "eve", "email": "e@example.com", "password": PASSWORD, "role": "developer",
        "tenant": "bob"}), 422)
    assert error["param"] == "tenant"
    assert (ApiKey.objects.count(), Member.objects.count()) == before


def test_tenant_admin_cannot_promote_to_platform_admin(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    target = alice.members[Role.DEVELOPER]
    assert_openai_error(admin.patch(f"/api/v1/members/{target.pk}",
                                    {"role": "platform_admin"}), 403)
    assert_openai_error(admin.post("/api/v1/members", {
        "username": "boss", "email": "b@example.com", "password": PASSWORD,
        "role": "platform_admin"}), 403)
    target.refresh_from_db()
    assert target.role == Role.DEVELOPER
    assert not Member.objects.filter(user__username="boss").exists()


def test_demotion_revokes_keys_the_new_role_cannot_hold(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    auditor = alice.members[Role.AUDITOR]
    assert admin.patch(f"/api/v1/members/{auditor.pk}", {"role": "developer"}).status == 200
    assert_openai_error(ApiClient(alice.keys[Role.AUDITOR]).get("/api/v1/me"), 401)
    assert ApiKey.objects.get(pk=alice.key_rows[Role.AUDITOR].pk).revoked_at is not None


def test_last_admin_cannot_be_removed_or_demoted(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    me = alice.members[Role.TENANT_ADMIN]
    assert_openai_error(admin.patch(f"/api/v1/members/{me.pk}", {"role": "developer"}), 409)
    assert_openai_error(admin.delete(f"/api/v1/members/{me.pk}"), 409)
    me.refresh_from_db()
    assert me.role == Role.TENANT_ADMIN and me.is_active


def test_member_create_validates_password_and_username(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    weak = assert_openai_error(admin.post("/api/v1/members", {
        "username": "weak", "email": "w@example.com", "password": "123", "role": "developer"}),
        422)
    assert weak["param"] == "password"
    taken = assert_openai_error(admin.post("/api/v1/members", {
        "username": "alice-developer", "email": "w@example.com", "password": PASSWORD,
        "role": "developer"}), 409)
    assert taken["param"] == "username"
    created = admin.post("/api/v1/members", {"username": "carol", "email": "c@example.com",
                                             "password": PASSWORD, "role": "auditor"})
    assert created.status == 201 and created.body["role"] == "auditor"
    assert "password" not in created.body


def test_platform_admin_creates_tenant_with_first_admin(ops: Org, anon: ApiClient) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    created = pa.post("/api/v1/tenants", {"slug": "acme", "name": "Acme", "admin": {
        "username": "acme-admin", "email": "a@acme.example", "password": PASSWORD}})
    assert created.status == 201
    assert_openai_error(pa.post("/api/v1/tenants", {"slug": "acme", "name": "Again"}), 409)
    assert_openai_error(pa.post("/api/v1/tenants", {"slug": "Not A Slug!", "name": "x"}), 422)
    token = anon.post("/v1/auth/token", {"grant_type": "password", "username": "acme-admin",
                                         "password": PASSWORD}).body["access_token"]
    assert ApiClient(token).get("/api/v1/me").body["tenant"] == "acme"


def test_disabled_tenant_locks_out_its_keys(alice: Org, ops: Org) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    assert pa.patch(f"/api/v1/tenants/{alice.tenant.pk}", {"is_active": False}).status == 200
    assert_openai_error(alice.client(Role.DEVELOPER).get("/api/v1/me"), 401)
    assert not Tenant.objects.get(pk=alice.tenant.pk).is_active


def test_lists_are_paginated(alice: Org) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    for n in range(5):
        admin.post("/api/v1/keys", {"name": f"k{n}"})
    page = admin.get("/api/v1/keys?limit=2&offset=1").body
    assert page["count"] == 8 and len(page["items"]) == 2
    assert_openai_error(admin.get("/api/v1/keys?limit=-1"), 422)
    # Past the maximum page size (100) is a clear 422, not a silent full-table read.
    assert assert_openai_error(admin.get("/api/v1/keys?limit=101"), 422)["param"] == "limit"
